"""A GPT training job under ``torchrun --max-restarts=1`` loses a rank mid-run (SIGKILL from outside), restarts,
resumes from its last checkpoint and ends with the losses of an uninterrupted run."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_examples import _gpt_losses
from world import run_on_world

pytestmark = pytest.mark.gloo

REPO = Path(__file__).resolve().parent.parent
STEPS, EVERY = 16, 4


def _torchrun(directory: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", *extra]
    cmd += ["examples/gpt.py", "--mode", "dp", "--steps", str(STEPS), "--checkpoint-dir", str(directory)]
    cmd += ["--checkpoint-every", str(EVERY), "--resume"]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _worker_pid(agent: int, rank: int) -> int | None:
    """The pid of the first-attempt worker of ``rank`` that torchrun's agent process ``agent`` started."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent == agent and f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RESTART_COUNT=0" in environ:
            return int(entry)
    return None


def _losses(output: str) -> list[float]:
    lines = [line for line in output.splitlines() if line.startswith("dp     losses ") and "->" not in line]
    assert lines, output
    return [float(x) for x in lines[-1].split()[2:]]


def test_a_killed_rank_restarts_the_job_which_resumes_to_the_same_losses(tmp_path):
    restarted = _torchrun(tmp_path / "killed", "--max-restarts", "1")
    deadline = time.monotonic() + 240
    while not (tmp_path / "killed" / "dp").exists():  # the first checkpoint is published: kill rank 1 now
        assert restarted.poll() is None and time.monotonic() < deadline, restarted.communicate()[0]
        time.sleep(0.01)
    victim = _worker_pid(restarted.pid, 1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    want = run_on_world(4, _gpt_losses, "dp", STEPS)[0][1]  # the same training, uninterrupted
    out_killed, _ = restarted.communicate(timeout=240)
    assert restarted.returncode == 0, out_killed
    assert "resumed from the checkpoint after step" in out_killed, out_killed
    resumed_at = int(out_killed.split("resumed from the checkpoint after step")[1].split()[0])
    assert EVERY <= resumed_at < STEPS  # killed mid-run, after at least one checkpoint
    got = _losses(out_killed)
    assert len(got) == len(want) == STEPS
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= 1e-6, (got, want)
