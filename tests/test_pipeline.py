"""``sbp_torch.pipeline.Pipeline`` on real gloo worlds against single-process training; the actor runtime's
register quotas (activations in flight); bad input refused on every rank."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

import sbp_torch as st
from sbp_torch.pipeline import Pipeline, PipelineError
from sbp_torch.pipeline import _actors as actors
from sbp_torch.sbp import broadcast, split

from world import run_on_world

WIDTH, STEPS = 6, 3


def _layers(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(n)]


def _batches(rows: int):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, WIDTH, generator=gen), torch.randn(rows, WIDTH, generator=gen)) for _ in range(STEPS)]


def _reference(n_layers: int, rows: int, frozen_first: bool = False):
    model = nn.Sequential(*_layers(n_layers))
    model[0].requires_grad_(not frozen_first)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for x, y in _batches(rows):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach() for p in model.parameters()]


# layout -> (stage placements as rank lists, per-stage parameter plan, input SBP, layers per stage)
LAYOUTS = {
    "one rank per stage": (None, None, None, 1),
    "data parallel stages": ([[0, 1], [2, 3]], None, split(0), 2),
    "tensor parallel stages": (
        [[0, 1], [2, 3]],
        [{"0.weight": split(0), "0.bias": split(0)}, {"0.weight": split(1)}],
        broadcast,
        1,
    ),
    "interleaved stages": ("two per rank, round robin", None, None, 1),
    "sharded data parallel stages": ([[0, 1], [2, 3]], None, split(0), 2),
}
SHARDED = {"sharded data parallel stages"}  # stages laid out with shard=0: parameters split, gathered on use


def _pipelined(
    world: int, layout: str, schedule: str, micro_batches: int, rows: int, device: str = "cpu", frozen_first=False
):
    ranks, plans, input_sbp, per_stage = LAYOUTS[layout]
    ranks = _stage_ranks(ranks, world)
    layers = _layers(len(ranks) * per_stage)
    layers[0].requires_grad_(not frozen_first)
    stages = []
    for s, group in enumerate(ranks):
        stage = nn.Sequential(*(m for layer in layers[s * per_stage : (s + 1) * per_stage] for m in layer))
        shard = 0 if layout in SHARDED else None
        stages.append(stage.to_global(st.placement(device, group), plans[s] if plans else None, shard=shard))
    pipe = Pipeline(stages, nn.functional.mse_loss, micro_batches, schedule, input_sbp=input_sbp, target_sbp=input_sbp)
    params = [p for stage in stages for p in stage.parameters()]
    opt = torch.optim.Adam(params, lr=0.01)
    losses, peaks = [], {}
    for x, y in _batches(rows):
        opt.zero_grad()
        losses.append(pipe.step(x, y))
        opt.step()
        for stage, peak in pipe.peak_activations.items():
            peaks[stage] = max(peak, peaks.get(stage, 0))
    me = torch.distributed.get_rank()
    full = {i: p.detach().full_tensor().cpu() for i, p in enumerate(params) if me in p.placement}
    return losses, full, len(stages), peaks


def _stage_ranks(ranks, world: int) -> list[list[int]]:
    if ranks is None:
        return [[r] for r in range(world)]
    if ranks == "two per rank, round robin":
        return [[s % world] for s in range(2 * world)]
    return ranks


CASES = [
    (2, "one rank per stage", "1f1b", 4, 8),
    (2, "one rank per stage", "gpipe", 3, 7),  # uneven: 3, 2, 2
    (4, "one rank per stage", "1f1b", 6, 11),  # uneven: 2, 2, 2, 2, 2, 1
    (4, "one rank per stage", "gpipe", 4, 8),
    (4, "data parallel stages", "1f1b", 4, 12),
    (4, "sharded data parallel stages", "1f1b", 4, 12),
    (4, "tensor parallel stages", "gpipe", 3, 6),
    (2, "interleaved stages", "1f1b", 5, 9),  # uneven: 2, 2, 2, 2, 1
    (4, "interleaved stages", "gpipe", 4, 8),
]


@pytest.mark.gloo
@pytest.mark.parametrize("world,layout,schedule,micro_batches,rows", CASES)
def test_matches_one_process(world, layout, schedule, micro_batches, rows):
    results = run_on_world(world, _pipelined, world, layout, schedule, micro_batches, rows)
    ranks, _, _, per_stage = LAYOUTS[layout]
    want_losses, want_params = _reference(len(_stage_ranks(ranks, world)) * per_stage, rows)
    for losses, params, p, peaks in results:
        assert losses == pytest.approx(want_losses, rel=1e-5)
        assert params, "every rank holds the parameters of its stages"
        for i, got in params.items():
            torch.testing.assert_close(got, want_params[i], rtol=1e-5, atol=1e-6)
        # the forward register's quota is what bounds the activations kept alive
        for stage, peak in peaks.items():
            if schedule == "1f1b":
                assert peak <= p - stage <= p
            else:
                assert peak == micro_batches


@pytest.mark.gloo
def test_a_first_stage_that_trains_nothing():
    """The first layer frozen (fine-tuning the later ones): its stage has no gradient to pass back."""
    results = run_on_world(2, _pipelined, 2, "one rank per stage", "1f1b", 4, 8, frozen_first=True)
    want_losses, want_params = _reference(2, 8, frozen_first=True)
    for losses, params, _, _ in results:
        assert losses == pytest.approx(want_losses, rel=1e-5)
        for i, got in params.items():
            torch.testing.assert_close(got, want_params[i], rtol=1e-5, atol=1e-6)


class _Noisy(nn.Module):
    """Adds zero times a draw of ``exponential_``, a random op that takes the broadcast fallback."""

    def forward(self, x):
        return x + torch.empty_like(x).exponential_() * 0


def _noisy_stages():
    layers = _layers(2)
    stages = [nn.Sequential(layer, _Noisy()).to_global(st.placement("cpu", [r])) for r, layer in enumerate(layers)]
    pipe = Pipeline(stages, nn.functional.mse_loss, 4, "1f1b")
    return [pipe.step(x, y) for x, y in _batches(8)]


@pytest.mark.gloo
def test_a_stage_drawing_through_the_fallback():
    """Each rank runs its own stage's ops alone: a random op there takes no call of the other ranks."""
    model = nn.Sequential(*_layers(2))
    want = [nn.functional.mse_loss(model(x), y).item() for x, y in _batches(8)]
    for losses in run_on_world(2, _noisy_stages):
        assert losses == pytest.approx(want, rel=1e-5)


# ---- a parameter tied across stages ------------------------------------------------------------------------


def _tied_reference(rows: int, steps: int):
    """One Linear applied twice (as stage 0 and stage 1), gradients accumulated over ``steps`` batches."""
    torch.manual_seed(0)
    shared = nn.Linear(WIDTH, WIDTH)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Tanh())
    for x, y in _batches(rows)[:steps]:
        nn.functional.mse_loss(model(x), y).backward()
    return [p.grad for p in shared.parameters()]


def _tied_pipelined(rows: int, steps: int, sbp1):
    torch.manual_seed(0)
    shared = nn.Linear(WIDTH, WIDTH)
    other = nn.Linear(WIDTH, WIDTH)  # different values: the pipeline copies stage 0's in
    stages = [
        nn.Sequential(shared, nn.Tanh()).to_global(st.placement("cpu", [0, 1]), {"0.weight": split(1)}),
        nn.Sequential(other, nn.Tanh()).to_global(st.placement("cpu", [2]), sbp1),
    ]
    pipe = Pipeline(
        stages, nn.functional.mse_loss, 2, "1f1b", tied=[("0.0.weight", "1.0.weight"), ("0.0.bias", "1.0.bias")]
    )
    for x, y in _batches(rows)[:steps]:  # no zero_grad: gradients accumulate over the steps
        pipe.step(x, y)
    me = torch.distributed.get_rank()
    return [p.grad.full_tensor() for stage in stages for p in stage.parameters() if me in p.placement]


@pytest.mark.gloo
@pytest.mark.parametrize("sbp1", [broadcast, {"0.weight": split(0)}])
def test_tied_copies_get_the_shared_gradient(sbp1):
    want = _tied_reference(5, 2)
    for grads in run_on_world(3, _tied_pipelined, 5, 2, sbp1):
        assert len(grads) == 2
        for got, expected in zip(grads, want):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _bad_tie(names) -> str:
    layers = _layers(2)
    stages = [layers[0].to_global(st.placement("cpu", [0])), layers[1].to_global(st.placement("cpu", [1]))]
    try:
        Pipeline(stages, nn.functional.mse_loss, 2, tied=[names])
    except ValueError as err:
        return str(err)
    return "accepted"


@pytest.mark.gloo
@pytest.mark.parametrize(
    "names,message",
    [
        (("0.0.weight", "1.0.bias"), "differ"),
        (("0.0.weight", "1.0.nothing"), "stage 1 has no parameter '0.nothing'"),
        (("0.0.weight", "0.0.weight"), "two on one stage"),
        (("0.0.weight", "7.0.weight"), "stage index below 2"),
    ],
)
def test_bad_ties_refused(names, message):
    for got in run_on_world(2, _bad_tie, names):
        assert message in got, got


# ---- the runtime alone: quotas make the schedule ----------------------------------------------------------


def _one_stage_order(slots: int, m: int) -> list[str]:
    """Order of a stage's forwards and backwards when gradients are always at hand."""
    runtime, order = actors.Runtime(), []
    saved = actors.Register("forward", slots, read_when_full=True)
    runtime.add(actors.Actor("F", lambda i, _: (order.append(f"F{i}") or i,), m, outputs=[saved]))
    runtime.add(actors.Actor("B", lambda i, _: order.append(f"B{i}") or (), m, inputs=[saved]))
    runtime.run()
    assert saved.peak == slots
    assert [(e.actor, e.index) for e in runtime.events] == [(name[0], int(name[1:])) for name in order]
    return order


def test_quotas_make_gpipe_and_1f1b():
    assert _one_stage_order(4, 4) == ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]
    assert _one_stage_order(2, 4) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]


def test_pending_work_wakes_the_loop():
    """An asynchronous actor finishing on another thread wakes the idle loop, which then runs its consumer;
    the actor fires again only after its previous firing finished."""
    runtime, order = actors.Runtime(check_every=5.0), []
    fetched = actors.Register("fetched", 2)
    done = {}

    def fetch(i, _):
        def finish():
            time.sleep(0.01)
            done[i] = True
            runtime.notify()

        threading.Thread(target=finish).start()
        return actors.Pending(lambda: (i,) if done.get(i) else None)

    runtime.add(actors.Actor("fetch", fetch, 2, outputs=[fetched], kind="transfer"))
    runtime.add(actors.Actor("use", lambda i, inputs: order.append(inputs[0]) or (), 2, inputs=[fetched]))
    start = time.perf_counter()
    runtime.run()
    assert time.perf_counter() - start < 2.0, "notify() must wake the loop, not the 5 s check timer"
    assert order == [0, 1] and fetched.peak == 1
    kinds = {e.actor: e.kind for e in runtime.events}
    assert kinds == {"fetch": "transfer", "use": "compute"}


def test_body_errors_and_idle_checks_propagate():
    runtime = actors.Runtime()
    runtime.add(actors.Actor("raises", lambda i, _: 1 / 0, 1))
    with pytest.raises(ZeroDivisionError):
        runtime.run()

    class Stop(Exception):
        pass

    def check():
        raise Stop

    runtime = actors.Runtime(check=check, check_every=0.001)
    runtime.add(actors.Actor("waits", lambda i, _: actors.Pending(lambda: None), 1))
    with pytest.raises(Stop):
        runtime.run()


def test_stuck_graph_raises():
    runtime = actors.Runtime()
    never = actors.Register("never", 1)
    runtime.add(actors.Actor("waits", lambda i, _: (), 1, inputs=[never]))
    with pytest.raises(RuntimeError, match=r"stuck: nothing ready and nothing in flight: \['waits \(0/1\)'\]"):
        runtime.run()
    with pytest.raises(ValueError, match="at least one slot"):
        actors.Register("empty", 0)


# ---- bad input ----------------------------------------------------------------------------------------------


def _refusal(case: str) -> str:
    layers = _layers(3)
    p0, p1, both = st.placement("cpu", [0]), st.placement("cpu", [1]), st.placement("cpu", [0, 1])
    if case == "overlap":
        stages = [layers[0].to_global(both), layers[1].to_global(p1)]
    elif case == "consecutive":
        stages = [layers[0].to_global(p0), layers[1].to_global(p0), layers[2].to_global(p1)]
    elif case == "uncovered":
        stages = [layers[0].to_global(p0)]
    elif case == "two placements":
        stages = [nn.Sequential(layers[0].to_global(p0), layers[1].to_global(p1)), layers[2].to_global(p1)]
    else:
        stages = [layers[0].to_global(p0), layers[1].to_global(p1)]
    try:
        pipe = Pipeline(stages, nn.functional.mse_loss, 4, "gpipe" if case != "schedule" else "zigzag")
        pipe.step(torch.randn(3, WIDTH), torch.randn(3, WIDTH))  # "small batch": 3 rows for 4 micro-batches
    except ValueError as err:
        return str(err)
    return "accepted"


@pytest.mark.gloo
@pytest.mark.parametrize(
    "case,message",
    [
        ("overlap", r"rank 1 is in the placements of stages \[0, 1\], and stage 0 has several ranks"),
        ("consecutive", "rank 0 holds the consecutive stages 0 and 1"),
        ("uncovered", r"rank\(s\) \[1\] .* in no stage"),
        ("two placements", "stage 0 has parameters on two placements"),
        ("schedule", "unknown schedule 'zigzag'"),
        ("small batch", "cannot be split into 4 micro-batches"),
    ],
)
def test_bad_input_refused_on_every_rank(case, message):
    for got in run_on_world(2, _refusal, case):
        assert got != "accepted"
        assert pytest.importorskip("re").search(message, got), got


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise ValueError("boom in a stage")


class _Boom(nn.Module):
    """``layer``, except that on ``rank`` its third forward raises, or the backward of that forward does."""

    def __init__(self, layer: nn.Module, rank: int, where: str):
        super().__init__()
        self.layer, self.rank, self.where, self.calls = layer, rank, where, 0

    def forward(self, x):
        self.calls += 1
        y = self.layer(x)
        if self.calls == 3 and torch.distributed.get_rank() == self.rank:
            if self.where == "forward":
                raise ValueError("boom in a stage")
            y = _RaiseInBackward.apply(y)
        return y


FAILURES = [(rank, where) for rank in range(3) for where in ["forward", "backward"]]


def _stage_errors(device: str = "cpu") -> list:
    """For each failure: the error every rank raised, whether a step on the same pipeline afterwards matched
    one process (loss and gradients), and (CUDA) the stream scheduler's tickets still held after it. That step
    meets no receive or send left posted by the failure: those would take its messages, or make it wait."""
    (x0, y0), (x1, y1) = _batches(8)[:2]
    reference = nn.Sequential(*_layers(3))
    expected = nn.functional.mse_loss(reference(x1), y1)
    expected.backward()
    out = []
    for rank, where in FAILURES:
        layers = _layers(3)
        stages = [
            (_Boom(layer, rank, where) if s == rank else layer).to_global(st.placement(device, [s]))
            for s, layer in enumerate(layers)
        ]
        pipe = Pipeline(stages, nn.functional.mse_loss, 4, "1f1b")
        try:
            pipe.step(x0, y0)
            error = "no error"
        except PipelineError as err:
            error = str(err)
        (here,) = pipe.local_stages
        for p in stages[here].parameters():
            p.grad = None
        loss = pipe.step(x1, y1)
        mine = [p.grad.full_tensor().cpu() for p in stages[here].parameters()]
        theirs = [p.grad for p in reference[here].parameters()]
        staging = pipe._lanes.staging
        out.append(
            (
                error,
                abs(loss - expected.item()) < 1e-6
                and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(mine, theirs)),
                staging.scheduler.outstanding if staging is not None else 0,
            )
        )
    return out


@pytest.mark.gloo
def test_stage_error_stops_every_rank_and_the_pipeline_goes_on():
    for results in run_on_world(3, _stage_errors, _timeout=60):
        check_stage_errors(results)


def check_stage_errors(results) -> None:
    for (rank, where), (error, next_step_matches, tickets_held) in zip(FAILURES, results):
        assert f"stage {rank} on rank {rank} raised ValueError: boom in a stage" in error, (rank, where, error)
        assert next_step_matches, (rank, where)
        assert tickets_held == 0, (rank, where)
