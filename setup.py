"""Install sbp_torch.

The package is pure Python today. torch is a runtime requirement only: nothing here imports it, so a build
environment without torch never pulls a (multi-GB) CUDA build in, and an installed torch >= 2.11 is kept.
"""

from setuptools import find_packages, setup

setup(
    name="sbp_torch",
    version="0.1.0",
    description="OneFlow-style global tensors (placement + SBP) for PyTorch",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["sbp_torch", "sbp_torch.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "numpy"],  # numpy only to keep torch from warning at import
    extras_require={
        "test": ["pytest>=7", "hypothesis>=6", "expecttest"],  # expecttest: imported by torch's OpInfo database
        "bench": ["matplotlib"],
    },
)
