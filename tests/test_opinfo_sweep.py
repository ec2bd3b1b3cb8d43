"""The OpInfo sweep (``tests/opinfo/opinfo_sweep.py``) on a fixed subset of op_db, on a 2-rank world.

A CI-sized slice of ``docs/coverage.md``: about fifty entries of the main families (unary and binary
pointwise, reductions, matmul, views, softmax, losses, norms) run with random layouts (split on any dim, uneven
included, broadcast, partial sum), forward and backward, against one process, the outputs' strides and
contiguity too. Each entry of ``EXPECTED_PASS`` must pass and report plain torch's strides; each of
``EXPECTED_FAILURES`` must still fail (when one starts passing, move it: the lists are reviewed, as in PyTorch's
own DTensor OpInfo test). ``NATIVE`` entries must also run without sbp_torch's broadcast fallback.

The sweep runs once, under ``torchrun`` in a subprocess, like the full sweep does (about 20 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gloo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EXPECTED_PASS = [
    # pointwise
    "abs",
    "exp",
    "sigmoid",
    "clamp",
    "where",
    "nn.functional.relu",
    "nn.functional.gelu",
    "add",
    "mul",
    "sub",
    "div.no_rounding_mode",
    "pow",
    "maximum",
    "short",
    # reductions
    "sum",
    "mean",
    "amax",
    "argmax",
    "var",
    "std",
    "max.reduction_with_dim",
    "logsumexp",
    "norm",
    # matmul
    "mm",
    "bmm",
    "addmm",
    "matmul",
    "einsum",
    "nn.functional.linear",
    # views
    "view",
    "reshape",
    "transpose",
    "permute",
    "cat",
    "stack",
    "split",
    "squeeze",
    "unsqueeze",
    "expand",
    "flatten",
    "narrow",
    "select",
    # softmax, losses, norms, embedding
    "softmax",
    "log_softmax",
    "nn.functional.cross_entropy",
    "nn.functional.mse_loss",
    "nn.functional.nll_loss",
    "nn.functional.binary_cross_entropy_with_logits",
    "nn.functional.layer_norm",
    "nn.functional.embedding",
    # torch's formulas build plain index tensors: prod's backward, x[[1, 2]]
    "prod",
    "__getitem__",
]

# entry -> why it fails today (see docs/coverage.md for the full list)
EXPECTED_FAILURES = {
    "tensor_split": "a C++ composite reads the values of a global index tensor argument directly",
}

# Entries of the lead's own families (pointwise, matmul) that must run part by part, never gathered.
NATIVE = ["abs", "exp", "sigmoid", "add", "mul", "sub", "div.no_rounding_mode", "maximum", "mm", "bmm", "addmm"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("opinfo") / "sweep.json"
    entries = EXPECTED_PASS + sorted(EXPECTED_FAILURES)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        os.path.join(REPO, "tests", "opinfo", "opinfo_sweep.py"),
        "--mesh",
        "2",
        "--ops",
        ",".join(entries),
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.exists(), (
        f"the sweep wrote no results (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    )
    results = json.loads(out.read_text())
    assert results["meta"]["complete"], f"the sweep ended early (hang?):\n{done.stdout[-3000:]}"
    return results["entries"]


# Entries whose outputs take no gradient (integer results), or whose OpInfo says autograd is not supported
NO_BACKWARD = {"argmax", "short", "bmm.triton_optimized"}


@pytest.mark.parametrize("name", EXPECTED_PASS)
def test_entry_passes(sweep, name):
    record = sweep[name]
    assert record["status"] == "pass", f"{name}: {record['status']}: {record['detail']}"
    assert "metadata" not in record, f"{name}: an output reports other strides than plain torch's: {record['metadata']}"
    assert record["samples"] > 0
    assert (record["backward_samples"] > 0) == (name not in NO_BACKWARD), f"{name}: {record['backward_samples']}"


@pytest.mark.parametrize("name", sorted(EXPECTED_FAILURES))
def test_expected_failure_still_fails(sweep, name):
    record = sweep[name]
    assert record["status"] not in ("pass", "skipped"), (
        f"{name} now passes: move it from EXPECTED_FAILURES to EXPECTED_PASS"
    )


@pytest.mark.parametrize("name", NATIVE)
def test_entry_runs_without_fallback(sweep, name):
    assert sweep[name]["fallback"] == [], f"{name} gathered its inputs for {sweep[name]['fallback']}"
