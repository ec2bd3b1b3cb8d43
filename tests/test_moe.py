"""Mixture-of-experts training against one process, on 4 gloo ranks.

Unmodified ``transformers`` Mixtral, Qwen3-MoE and DeepSeek-V3 (``zoo/moe.py``, top-2 routing) train five AdamW steps
in data parallelism (experts broadcast: routing stays on each rank), expert parallelism (experts split over the 4
ranks: tokens travel by all-to-all) and both on a 2x2 grid; the losses and the last gradients must equal one
process's. Each layout's collectives are counted: data parallelism issues only the loss's and the gradients'
reductions, and expert parallelism exchanges tokens, three all-to-alls per layer forward (counts, dispatch,
combine) and two backward, and gathers no expert weight. An experts module on its own is fed a routing in which
one expert receives nothing and one rank's tokens all go to other ranks."""

from __future__ import annotations

import collections
import contextlib
import os

import pytest
import torch
import torch.distributed as dist

import sbp_torch as st
from sbp_torch import _comm as comm
from sbp_torch._api._explain import Explanation, recorder
from sbp_torch.sbp import broadcast, partial_sum, split

from world import run_on_world

pytest.importorskip("transformers")

from zoo import moe  # noqa: E402  (after the skip: it names transformers models)

pytestmark = pytest.mark.gloo

STEPS = 5


def _train(model, batches, lay_out=lambda t: t, observe=False):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, found = [], Explanation()
    for batch in batches:
        phase = {"backward": False}
        found = Explanation()
        batch = {k: lay_out(v) for k, v in batch.items()}  # (not counted: a dense model's batch moves alike)
        with comm.observing(recorder(found, phase)) if observe else contextlib.nullcontext():
            loss = model(**batch).loss
            optimizer.zero_grad()
            phase["backward"] = True
            loss.backward()
        optimizer.step()
        losses.append(loss.item())
    grads = {n: p.grad for n, p in model.named_parameters()}
    grads = {n: st.full_tensor(g) if isinstance(g, st.GlobalTensor) else g for n, g in grads.items()}
    return losses, grads, found


def _train_job(name, implementation, layout, rows):
    batches = moe.batches(STEPS, rows)
    want, want_grads, _ = _train(moe.make(name, implementation), batches)
    model = moe.make(name, implementation)
    lay = moe.lay_out(model, moe.LAYOUTS[layout])
    got, got_grads, found = _train(model, batches, lay, observe=True)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    grad_error = max(
        ((got_grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-3)).item() for n, g in want_grads.items()
    )
    kinds = collections.Counter(
        (c.kind, c.backward, "expert" if "expert parallelism" in c.cause else "") for c in found
    )
    gathered = [c.cause for c in found if "gather" in c.kind and c.cause.startswith("aten.")]  # an op's inputs
    layers = sum(hasattr(m, "_is_expert_parallel") for m in model.modules())
    return worst, grad_error, dict(kinds), gathered, layers


CASES = [
    ("mixtral", "grouped_mm", "DP"),
    ("mixtral", "grouped_mm", "EP"),
    ("mixtral", "grouped_mm", "DP x EP"),
    ("mixtral", "eager", "EP"),
    ("qwen3_moe", "grouped_mm", "DP"),
    ("qwen3_moe", "grouped_mm", "EP"),
    ("qwen3_moe", "eager", "DP x EP"),
    ("mixtral", "grouped_mm", "sharded DP x EP"),  # parameters stored split over the data axis, gathered per block
    ("deepseek_v3", "grouped_mm", "DP"),
    ("deepseek_v3", "grouped_mm", "EP"),
]


@pytest.mark.parametrize("name, implementation, layout", CASES)
def test_moe_trains_like_one_process(name, implementation, layout):
    # 8 rows: every rank holds 2 sequences; the routing leaves some experts without tokens on some ranks
    for worst, grad_error, kinds, gathered, layers in run_on_world(4, _train_job, name, implementation, layout, 8):
        assert worst < 1e-5, worst
        assert grad_error < 1e-4, grad_error
        assert not gathered, gathered  # neither routing nor an expert weight is gathered for an op
        if layout == "DP":
            assert set(k for k, _, _ in kinds) == {"all-reduce(sum)"}, kinds
        else:  # counts, dispatch and combine forward; the reverse of dispatch and combine backward
            assert kinds[("all-to-all", False, "expert")] == 3 * layers, kinds
            assert kinds[("all-to-all", True, "expert")] == 2 * layers, kinds
            assert sum(n for (k, _, _), n in kinds.items() if k == "all-to-all") == 5 * layers, kinds


def _uneven_job():
    """Six rows on four ranks: parts of 2, 2, 1, 1 sequences."""
    batches = moe.batches(STEPS, 6)
    want, _, _ = _train(moe.make("mixtral"), batches)
    model = moe.make("mixtral")
    got, _, _ = _train(model, batches, moe.lay_out(model, moe.LAYOUTS["EP"]))
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def test_moe_uneven_batch():
    assert max(run_on_world(4, _uneven_job)) < 1e-5


# Routings of 8 tokens (2 per rank) over 4 experts. "spread": expert 1 receives no token, and the tokens of rank 0
# (rows 0 and 1) all go to experts 2 and 3, held by ranks 2 and 3. "first": every token goes to experts 0 and 1,
# so with one expert per rank, ranks 2 and 3 receive nothing and their experts get zero gradients.
ROUTINGS = {
    "spread": [[2, 3], [3, 2], [0, 2], [0, 3], [2, 0], [3, 0], [0, 2], [2, 3]],
    "first": [[0, 1], [1, 0]] * 4,
}


def _experts_job(layout_name, implementation, experts, rows, routing):
    """An experts module alone, laid out by ``layout_name``, fed the first ``rows`` tokens of ``routing`` (expert
    ids taken modulo ``experts``), against one process: output and every gradient."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=8, intermediate_size=4, num_local_experts=experts)
    config._experts_implementation = implementation
    torch.manual_seed(0)
    reference = MixtralExperts(config)
    torch.nn.init.normal_(reference.gate_up_proj)
    torch.nn.init.normal_(reference.down_proj)
    model = MixtralExperts(config)
    model.load_state_dict(reference.state_dict())
    hidden = torch.randn(rows, 8)
    index = torch.tensor(ROUTINGS[routing][:rows]) % experts
    if experts == 2:  # top-2 of two experts: both, in either order
        index = torch.tensor([[0, 1], [1, 0]] * 4)[:rows]
    weights = torch.rand(rows, 2)
    h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
    gen = torch.Generator().manual_seed(3)
    upstream = torch.randn(rows, 8, generator=gen)
    (reference(h, index, w) * upstream).sum().backward()

    p = st.placement("cpu", [0, 1, 2, 3])
    experts_sbp, token_sbp = {"EP": (split(0), split(0)), "DP": (broadcast, split(0))}.get(
        layout_name, (split(0), broadcast)
    )
    model.to_global(p, experts_sbp)
    as_global = lambda t: st.to_global(t, p, broadcast).to_global(sbp=token_sbp)  # noqa: E731
    gh = as_global(hidden).detach().requires_grad_()
    gw = as_global(weights).detach().requires_grad_()
    out = model(gh, as_global(index), gw)
    (out * as_global(upstream)).sum().backward()
    pairs = [
        (out, reference(hidden, index, weights)),
        (gh.grad, h.grad),
        (gw.grad, w.grad),
        (model.gate_up_proj.grad, reference.gate_up_proj.grad),
        (model.down_proj.grad, reference.down_proj.grad),
    ]
    # relative to each tensor's largest value: normal weights make outputs of tens, where float32 rounds at 1e-6
    return out.sbp, max(((st.full_tensor(a) - b).abs().max() / b.abs().max().clamp_min(1e-6)).item() for a, b in pairs)


@pytest.mark.parametrize(
    "layout_name, implementation, experts, rows, routing",
    [
        ("EP", "grouped_mm", 4, 8, "spread"),
        ("EP", "eager", 4, 8, "first"),  # ranks that receive no row still run the backward exchanges
        ("EP", "grouped_mm", 2, 8, "spread"),  # fewer experts than ranks: two ranks hold none
        ("EP", "eager", 4, 2, "spread"),  # two ranks hold no token
        ("DP", "eager", 4, 2, "spread"),
        ("DP", "grouped_mm", 4, 8, "spread"),
        ("tokens broadcast", "grouped_mm", 4, 8, "spread"),
        ("tokens broadcast", "eager", 2, 8, "spread"),
    ],
)
def test_experts_module_with_empty_experts_and_ranks(layout_name, implementation, experts, rows, routing):
    for sbp, error in run_on_world(4, _experts_job, layout_name, implementation, experts, rows, routing):
        assert error < 1e-5, error
        assert sbp == ((partial_sum,) if layout_name == "tokens broadcast" else (split(0),))


def _explain_job():
    model = moe.make("mixtral")
    lay = moe.lay_out(model, moe.LAYOUTS["EP"])
    batch = moe.batches(1, 8)[0]
    found = st.explain(lambda b: model(**{k: lay(v) for k, v in b.items()}).loss, batch)
    return [(c.kind, c.bytes, c.backward) for c in found if "expert parallelism" in c.cause], str(found)


def test_explain_lists_data_dependent_exchanges():
    for exchanges, text in run_on_world(4, _explain_job):
        dependent = [e for e in exchanges if e[1] is None]
        assert len(dependent) == 2 * (2 + 2), exchanges  # per layer: dispatch and combine, forward and backward
        assert "data-dependent" in text


def _compiled_job():
    """The forward compiled (aot_eager); the experts regions run eagerly between its graphs."""
    batches = moe.batches(2, 8)
    want, _, _ = _train(moe.make("mixtral"), batches)
    model = moe.make("mixtral")
    # (2 ranks: the compile on each rank is the cost, and 4 ranks share CI's 2 cores)
    lay = moe.lay_out(model, moe.Layout("EP", [0, 1], (split(0),), (split(0),)))
    compiled = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    got = []
    for batch in batches:
        loss = compiled(**{k: lay(v) for k, v in batch.items()}).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        got.append(loss.item())
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def test_moe_compiled():
    assert max(run_on_world(2, _compiled_job, _timeout=300)) < 1e-5


def _compile_step_job(name, layout, backend):
    """Five AdamW steps through ``compile_step``: the first eager, the rest one traced program that must route each
    batch anew (each batch routes its tokens otherwise); each step's loss against one process's. ``layout``: one of
    ``moe.LAYOUTS`` on 4 ranks, or of ``ONE_RANK``."""
    batches = moe.batches(STEPS, 8)
    want, _, _ = _train(moe.make(name), batches)
    model = moe.make(name)
    lay = moe.lay_out(model, ONE_RANK[layout] if dist.get_world_size() == 1 else moe.LAYOUTS[layout])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    @st.compile_step(model=model, optimizer=optimizer, backend=backend)
    def step(ids):
        x = lay(ids)
        loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss

    got = [step(batch["input_ids"]).full_tensor().item() for batch in batches]
    return [abs(a - b) / abs(b) for a, b in zip(got, want)], step.traces


ONE_RANK = {
    "DP": moe.Layout("DP", [0], (broadcast,), (split(0),)),
    "EP": moe.Layout("EP", [0], (split(0),), (split(0),)),
}
# (model, layout, backend, ranks): each layout's program kind once (Inductor's compile of a model this size takes a
# minute on CI's two cores: test_compile_step compiles data-dependent routing with it on a small program).
# MOE_COMPILE_MATRIX=1 runs every model in every layout with both backends, on 4 ranks and on 1.
COMPILED_CASES = [
    ("mixtral", "EP", None, 4),
    ("qwen3_moe", "DP x EP", None, 4),
    ("deepseek_v3", "DP", None, 4),
    ("mixtral", "sharded DP x EP", None, 4),
]
if os.environ.get("MOE_COMPILE_MATRIX"):
    COMPILED_CASES = [
        (name, layout, backend, ranks)
        for name in moe.MODELS
        for backend in ("inductor", None)
        for ranks, layouts in ((4, moe.LAYOUTS), (1, ONE_RANK))
        for layout in layouts
    ]


@pytest.mark.parametrize("name, layout, backend, ranks", COMPILED_CASES)
def test_moe_compile_step_routes_every_batch(name, layout, backend, ranks):
    for errors, traces in run_on_world(ranks, _compile_step_job, name, layout, backend, _timeout=600):
        assert max(errors) < 1e-5, errors  # every step, each traced call after the first
        assert traces == 1
