"""A lost rank is an error on every rank, never a hang (docs/faults.md): a killed rank, an exception in one rank's
local op, a failing pipeline stage; errors raised alike on every rank leave the world usable.

A fault closes the world, so each fault test ends with every rank raising (the harness then starts a fresh world).
The harness gives the other ranks only seconds once one has failed, so a rank that raised first waits, through
the store, until every live rank has raised: a test fails only if some rank truly waits."""

import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import sbp_torch as st
from sbp_torch import CollectiveError
from sbp_torch import _comm as comm
from sbp_torch._comm import AxisGroup
from sbp_torch.pipeline import Pipeline
from sbp_torch.sbp import broadcast, split

from world import PG_TIMEOUT, RankFailure, run_on_world

SOON = 15.0  # seconds: how soon the others must raise, a quarter of the harness' collective timeout
assert SOON < PG_TIMEOUT.total_seconds() / 2


def _raise_when_all_raised(err: BaseException, store, key: str, ranks: int, since: float):
    """Note how long after ``since`` this rank raised; wait until ``ranks`` ranks have, then raise ``err``."""
    err.add_note(f"raised {time.time() - since:.3f} s after the failure")
    store.add(key, 1)
    deadline = time.monotonic() + 2 * SOON
    while int(store.add(key, 0)) < ranks and time.monotonic() < deadline:
        time.sleep(0.02)
    raise err


def _seconds_after_failure(failure: str, rank: int) -> float:
    """The time noted in a rank's failure (shown by ``pytest -s``)."""
    seconds = float(re.search(r"raised ([0-9.]+) s after the failure", failure).group(1))
    print(f"rank {rank} raised {seconds:.3f} s after the failure")
    return seconds


def _killed_mid_step():
    """Data parallel over 3 ranks; rank 1 is killed between the forward and the backward of a step, once the
    others are about to enter the backward's gradient all-reduce."""
    store, me = dist.distributed_c10d._get_default_store(), dist.get_rank()
    p = st.placement("cpu", [0, 1, 2])
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to_global(p)
    x = st.randn(6, 4, placement=p, sbp=split(0))
    model(x).sum().backward()  # a whole step first: every decision is cached
    loss = model(x).sum()
    if me == 1:
        store.wait(["faults/kill/0", "faults/kill/2"])
        time.sleep(0.2)
        store.set("faults/killed at", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    store.set(f"faults/kill/{me}", "")
    try:
        loss.backward()
    except CollectiveError as err:
        _raise_when_all_raised(err, store, "faults/raised", 2, float(store.get("faults/killed at")))


@pytest.mark.gloo
def test_a_killed_rank_is_an_error_on_every_other_rank():
    with pytest.raises(RankFailure) as caught:
        run_on_world(3, _killed_mid_step)
    failures = caught.value.failures
    assert caught.value.missing == [] and "worker died (exit code -9)" in failures[1]
    for rank in (0, 2):
        waited = "CollectiveError: all-reduce(sum) along axis 0 of placement(type='cpu', ranks=[0, 1, 2])"
        assert waited in failures[rank] and f"this rank is index {rank}" in failures[rank], failures[rank]
        assert _seconds_after_failure(failures[rank], rank) < SOON, failures[rank]


def _index_out_of_range_on_rank_1():
    """``index_select`` of a broadcast tensor by split indices, one of which (in rank 1's part) is out of range,
    while an all-reduce that rank 1 started (as a gradient bucket would) is still unwaited there."""
    store = dist.distributed_c10d._get_default_store()
    p = st.placement("cpu", [[0, 1, 2]])
    x = st.randn(5, 4, placement=p, sbp=(broadcast, broadcast))
    good = st.tensor([0, 1, 2, 3, 4, 4], placement=p, sbp=(broadcast, split(0)))
    bad = st.tensor([0, 1, 9, 3, 4, 4], placement=p, sbp=(broadcast, split(0)))
    torch.index_select(x, 0, good).sum().full_tensor()  # every decision cached: the next call fails in its kernel
    in_flight = comm.start_all_reduce(torch.ones(3), "sum", comm.axis_group(p, 1))
    dist.barrier()
    since = time.time()
    try:
        picked = torch.index_select(x, 0, bad)
        in_flight()
        picked.sum().full_tensor()  # an all-reduce along axis 1, that rank 1 never joins
    except (IndexError, CollectiveError) as err:
        _raise_when_all_raised(err, store, "faults/raised", 3, since)


def _every_rank_fails(fn) -> dict:
    """Each rank's failure (formatted traceback) when ``fn`` runs on a 3-rank world; every rank must fail."""
    with pytest.raises(RankFailure) as caught:
        run_on_world(3, fn)
    assert caught.value.missing == []
    return caught.value.failures


@pytest.mark.gloo
def test_an_exception_in_one_ranks_op_reaches_the_others_as_an_error():
    failures = _every_rank_fails(_index_out_of_range_on_rank_1)
    assert "IndexError: index out of range in self" in failures[1], failures[1]
    assert "rank 1 closed its process groups" in failures[1]
    for rank in (0, 2):
        assert (
            "CollectiveError: all-reduce(sum) along axis 1 of placement(type='cpu', ranks=[[0, 1, 2]]) "
            f"(ranks [0, 1, 2]), this rank is index {rank}"
        ) in failures[rank], failures[rank]
        assert "rank 1 raised IndexError in aten.index_select.default: index out of range in self" in failures[rank]
        assert _seconds_after_failure(failures[rank], rank) < SOON, failures[rank]


def _tensor_parallel_stage_fails():
    """Pipeline: stage 0 tensor parallel on ranks [0, 1], stage 1 on rank 2; rank 0's stage raises in the
    forward of the third micro-batch, where rank 1 goes on into the stage's collectives."""
    store, me = dist.distributed_c10d._get_default_store(), dist.get_rank()
    torch.manual_seed(0)
    first, second = (nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(2))
    stages = [
        first.to_global(st.placement("cpu", [0, 1]), {"0.weight": split(0), "0.bias": split(0)}),
        second.to_global(st.placement("cpu", [2])),
    ]
    pipe = Pipeline(stages, nn.functional.mse_loss, 4, "1f1b")
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    pipe.step(x, y)
    if me == 0:
        forward, calls = stages[0].forward, []

        def failing(inputs):
            calls.append(None)
            if len(calls) == 3:
                raise ValueError("boom in a stage")
            return forward(inputs)

        stages[0].forward = failing
    dist.barrier()
    since = time.time()
    try:
        pipe.step(x, y)
    except RuntimeError as err:
        _raise_when_all_raised(err, store, "faults/raised", 3, since)


@pytest.mark.gloo
def test_a_failing_tensor_parallel_stage_is_an_error_on_every_rank():
    failures = _every_rank_fails(_tensor_parallel_stage_fails)
    assert "ValueError: boom in a stage" in failures[0]
    for rank in range(3):
        assert "PipelineError" in failures[rank], failures[rank]
        assert "rank 0 raised ValueError in pipeline stage 0: boom in a stage" in failures[rank], failures[rank]
        assert _seconds_after_failure(failures[rank], rank) < SOON, failures[rank]


def _validation_errors_then_an_op():
    """Errors that every rank raises alike (in a kernel too, run on the same values everywhere); the world goes
    on."""
    torch.manual_seed(0)
    p = st.placement("cpu", [0, 1, 2])
    a = st.randn(6, 4, placement=p, sbp=split(0))
    b = st.randn(5, 3, placement=p, sbp=broadcast)
    other = st.placement("cpu", [0, 1])
    raised = []
    for bad in (
        lambda: a @ b,  # a shape error
        lambda: a + st.randn(6, 4, placement=other, sbp=broadcast),  # two placements
        lambda: torch.linalg.cholesky(-st.ones(3, 3, placement=p, sbp=broadcast)),  # a kernel's error, the same
    ):
        try:
            bad()
        except (RuntimeError, ValueError) as err:
            raised.append(type(err).__name__)
    c = st.randn(4, 3, placement=p, sbp=broadcast)
    return raised, (a @ c).full_tensor(), a.full_tensor() @ c.full_tensor()


@pytest.mark.gloo
def test_validation_errors_raise_on_every_rank_and_leave_the_world_usable():
    for raised, got, want in run_on_world(3, _validation_errors_then_an_op):
        assert raised == ["RuntimeError", "ValueError", "_LinAlgError"]  # torch.linalg.LinAlgError
        assert torch.allclose(got, want)


def _a_value_read_outside_its_placement():
    """``item()`` of a loss on ranks 0 and 1, called on every rank: rank 2 holds no part of it and raises alone, with
    its world left open (nothing waits for it), so all three go on to the next collective."""
    p = st.placement("cpu", [0, 1])
    loss = torch.tensor(3.5).to_global(p, broadcast)
    try:
        read = loss.item()
    except ValueError as err:
        read = str(err)
    world = st.placement("cpu", [0, 1, 2])
    return read, st.ones(3, placement=world, sbp=split(0)).sum().item()


@pytest.mark.gloo
def test_a_value_read_outside_its_placement_raises_there_alone():
    results = run_on_world(3, _a_value_read_outside_its_placement)
    assert [r[0] for r in results[:2]] == [3.5, 3.5]
    assert "does not hold this rank (2)" in results[2][0], results[2][0]
    assert [r[1] for r in results] == [3.0, 3.0, 3.0]


def test_messages_name_the_collective_the_placement_the_axis_and_the_ranks():
    p = st.placement("cpu", [[0, 1], [2, 3]])
    assert AxisGroup((2, 3), 0, None, p, 1).describe() == (
        "along axis 1 of placement(type='cpu', ranks=[[0, 1], [2, 3]]) (ranks [2, 3])"
    )
    assert AxisGroup((0, 1), 1, None).describe() == "on ranks [0, 1]"  # a bare group
