"""Every rank decides the same signatures even when Python's hash seeds differ (torchrun does not pin them)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gloo

JOB = os.path.join(os.path.dirname(__file__), "jobs", "decisions_job.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_decisions_do_not_depend_on_hash_seed():
    port = _free_port()
    procs = []
    for rank, seed in enumerate(["1", "12345"]):
        env = dict(
            os.environ,
            PYTHONHASHSEED=seed,
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, JOB], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{out}"
    agreed = re.search(r"(\d+) decisions agree", outputs[0])
    assert agreed is not None, outputs[0]
    assert int(agreed.group(1)) >= 30, f"only {agreed.group(1)} decisions were compared"
