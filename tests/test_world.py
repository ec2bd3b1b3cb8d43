"""Tests of the multi-rank harness itself (tests/world.py)."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from world import RankFailure, run_on_world

pytestmark = pytest.mark.gloo


def _rank_sum():
    t = torch.tensor([dist.get_rank()])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def _pid():
    return os.getpid()


def _fail_on(bad_rank):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom from rank {bad_rank}")
    dist.barrier()  # the other ranks block here until the world is killed


def _rank1_hangs():
    if dist.get_rank() == 1:
        time.sleep(1000)
    return "done"


def _exit_on_rank0():
    if dist.get_rank() == 0:
        os._exit(3)
    dist.barrier()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_all_reduce_of_ranks(n):
    total = n * (n - 1) // 2
    assert run_on_world(n, _rank_sum) == [(r, n, total) for r in range(n)]


def test_workers_are_reused():
    first = run_on_world(2, _pid)
    assert run_on_world(2, _pid) == first
    assert len(set(first)) == 2 and os.getpid() not in first


def test_exception_is_reported_and_world_restarts():
    before = run_on_world(3, _pid)
    with pytest.raises(RankFailure) as info:
        run_on_world(3, _fail_on, 2)
    msg = str(info.value)
    assert "rank(s) [2]" in msg and "--- rank 2 ---" in msg
    assert "Traceback" in msg and "ValueError: boom from rank 2" in msg and "_fail_on" in msg
    assert info.value.missing == [0, 1]  # stuck in the barrier, killed after the grace period
    after = run_on_world(3, _pid)
    assert not set(after) & set(before)
    assert run_on_world(3, _rank_sum)[0] == (0, 3, 3)


def test_timeout_kills_world_and_next_call_works():
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"timed out after 2s") as info:
        run_on_world(2, _rank1_hangs, _timeout=2)
    assert time.monotonic() - start < 10
    assert info.value.missing == [1] and not info.value.failures
    assert run_on_world(2, _rank_sum) == [(0, 2, 1), (1, 2, 1)]


def test_dead_worker_is_reported():
    with pytest.raises(RankFailure, match=r"worker died \(exit code 3\)") as info:
        run_on_world(2, _exit_on_rank0, _timeout=60)
    assert 0 in info.value.failures
    assert run_on_world(2, _rank_sum) == [(0, 2, 1), (1, 2, 1)]
