"""Shared pytest setup: the test tiers, hypothesis profiles and the multi-rank worlds' cleanup.

Tiers are markers, so one command selects one:

* ``gloo``: the test runs on real gloo process groups (``run_on_world``, or ``torchrun`` jobs);
* ``gpu``: the test needs a CUDA GPU (it skips without one);
* ``no_world``: every other test, which needs no process group (``pytest -m no_world`` runs in seconds).

``run_on_world`` refuses to run inside a test that is not marked ``gloo`` or ``gpu``, so a tier cannot hold a
test of another. Hypothesis runs derandomized (the profile ``ci``): a failure reproduces on the next run,
and its example is printed. ``HYPOTHESIS_PROFILE=explore`` draws fresh examples, more of them.

Multi-rank tests do ``from world import run_on_world`` (``tests/`` is on sys.path).
"""

import os

import pytest
from hypothesis import HealthCheck, settings

import world

# Inductor compiles in a pool of worker processes, one per core, started in every process that compiles: with several
# ranks per core that pool only adds processes to wait for (a small compiled program took 2.5x as long on 2 cores).
# Set before any world starts, so every rank inherits it; a value the caller set stays.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Inductor's CPU kernels compiled without SIMD code: a C++ compile of a scalar loop is faster (a 2x2 test of a small
# program compiled from a cold cache: 45 s, 33 s without), and a fresh CI machine compiles every kernel of the suite.
# What the tests check, how global programs are traced, lowered and compare with one process, is the same either way;
# TORCHINDUCTOR_VEC_ISA_OK=1 runs them with SIMD kernels.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True, print_blob=True
)
settings.register_profile(
    "explore", deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=500, print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

WORLD_TIERS = ("gloo", "gpu")


def pytest_collection_modifyitems(items):
    for item in items:
        if not any(item.get_closest_marker(tier) for tier in WORLD_TIERS):
            item.add_marker(pytest.mark.no_world)


@pytest.fixture(autouse=True)
def _tier_of_the_running_test(request):
    world.worlds_allowed = any(request.node.get_closest_marker(tier) for tier in WORLD_TIERS)
    yield
    world.worlds_allowed = True


def pytest_sessionfinish(session, exitstatus):
    world.shutdown_worlds()  # workers leave their process groups before exit
