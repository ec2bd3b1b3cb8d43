"""Pipelines on CUDA: the stream scheduler orders copies against compute by events alone, and pipelined
training on CUDA stages matches one process. Skips without a GPU. Two ranks may share one GPU (each its own
CUDA context), so one GPU runs every test here."""

from __future__ import annotations

import pytest
import torch

from sbp_torch.pipeline import _cuda_staging

from test_pipeline import CASES, LAYOUTS, _pipelined, _reference, _stage_errors, _stage_ranks, check_stage_errors
from world import run_on_world

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _scheduler():
    return _cuda_staging.StreamScheduler(torch.cuda.current_device())


def test_a_staged_copy_waits_for_the_compute_it_was_marked_after():
    sched = _scheduler()
    lane = sched.add_lane()
    compute = torch.cuda.current_stream()
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # keeps the compute stream busy for a while (about 0.1 s)
    x.fill_(7.0)
    after = sched.mark(compute)
    host = torch.empty(x.shape, pin_memory=True)
    ticket = sched.stage(lane, after, [(host, x)])  # on a high-priority copy stream: would run at once
    sched.wait(ticket)
    assert bool((host == 7.0).all()), "the copy ran before the compute it was marked after"
    sched.release(ticket)
    sched.release(after)
    assert sched.outstanding == 0


def test_compute_ordered_after_an_arriving_copy_sees_its_data():
    sched = _scheduler()
    lane = sched.add_lane()
    compute = torch.cuda.current_stream()
    n = 1 << 26  # 256 MB: the copy takes milliseconds, and compute would start at once without the order
    host = (torch.arange(n, dtype=torch.float32) % 3).pin_memory()  # pinned: the copy is truly asynchronous
    dev = torch.full((n,), float("nan"), device="cuda")
    torch.cuda.synchronize()
    ticket = sched.stage(lane, -1, [(dev, host)])
    sched.order(compute, ticket)
    total = dev.double().sum()  # queued on compute right away; runs after the copy
    assert float(total) == float(host.double().sum())
    sched.release(ticket)
    assert sched.outstanding == 0


def test_bad_tickets_and_sizes_are_refused():
    sched = _scheduler()
    lane = sched.add_lane()
    with pytest.raises((ValueError, RuntimeError), match="not held"):
        sched.wait(12345)
    with pytest.raises((ValueError, RuntimeError), match="differ in size"):
        sched.stage(lane, -1, [(torch.empty(3, pin_memory=True), torch.zeros(4, device="cuda"))])


def test_an_arriving_copy_does_not_take_memory_that_queued_compute_still_writes():
    """The copy stream does not wait for compute: memory it writes must not come from the compute stream's
    pool, where a freed block may still have compute queued on it."""
    staging = _cuda_staging.Staging(torch.device("cuda", torch.cuda.current_device()))
    n = 1 << 20
    host = (torch.arange(n, dtype=torch.float32) % 5).pin_memory()
    _, first = staging.to_device("channel", host)  # makes the lane first: creating a stream may wait for the GPU
    staging.arrive(first)
    staging.reap(wait=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    scratch = torch.empty(n, device="cuda")
    scratch.fill_(-1.0)  # queued behind the sleep
    del scratch  # its block is free for the compute stream, the fill still queued
    out, ticket = staging.to_device("channel", host)
    staging.arrive(ticket)
    assert torch.equal(out.cpu(), host), "the arriving copy was overwritten by compute queued before it"
    staging.reap(wait=True)
    assert staging.scheduler.outstanding == 0


def _cuda_pipelined(*args):
    torch.cuda.set_device(torch.distributed.get_rank() % torch.cuda.device_count())
    return _pipelined(*args, device="cuda")


# one rank per stage, GPipe and 1F1B, uneven micro-batches, and interleaved stages (several lanes per rank)
CUDA_CASES = [case for case in CASES if case[1] in ("one rank per stage", "interleaved stages") and case[0] == 2]


@pytest.mark.parametrize("world,layout,schedule,micro_batches,rows", CUDA_CASES)
def test_cuda_pipeline_matches_one_process(world, layout, schedule, micro_batches, rows):
    results = run_on_world(world, _cuda_pipelined, world, layout, schedule, micro_batches, rows)
    ranks, _, _, per_stage = LAYOUTS[layout]
    want_losses, want_params = _reference(len(_stage_ranks(ranks, world)) * per_stage, rows)
    for losses, params, _, _ in results:
        assert losses == pytest.approx(want_losses, rel=1e-5)
        assert params
        for i, got in params.items():
            torch.testing.assert_close(got, want_params[i], rtol=1e-5, atol=1e-6)


def _cuda_stage_errors():
    torch.cuda.set_device(torch.distributed.get_rank() % torch.cuda.device_count())
    return _stage_errors("cuda")


def test_cuda_stage_error_stops_every_rank_and_the_pipeline_goes_on():
    """A failed step on CUDA also lets go of its staged copies (no ticket stays held) and the next step matches."""
    for results in run_on_world(3, _cuda_stage_errors, _timeout=120):
        check_stage_errors(results)
