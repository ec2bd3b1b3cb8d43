"""Mixture-of-experts training and ``local_map`` regions against one process, on 4 gloo ranks.

Unmodified ``transformers`` Mixtral and Qwen3-MoE (``benchmarks/moe_models.py``, top-2 routing) train five AdamW steps
in data parallelism (experts broadcast: routing stays on each rank), expert parallelism (experts split over the 4
ranks: tokens travel by all-to-all) and both on a 2x2 grid; the losses and the last gradients must equal one
process's. Each layout's collectives are counted: data parallelism issues only the loss's and the gradients'
reductions, and expert parallelism exchanges tokens, three all-to-alls per layer forward (counts, dispatch,
combine) and two backward, and gathers no expert weight. An experts module on its own is fed a routing in which
one expert receives nothing and one rank's tokens all go to other ranks."""

from __future__ import annotations

import collections

import pytest
import torch

import sbp_torch as st
from sbp_torch import _comm as comm
from sbp_torch._api._explain import Explanation, recorder
from sbp_torch.sbp import broadcast, partial_sum, split

from world import run_on_world

pytest.importorskip("transformers")

from benchmarks import moe_models  # noqa: E402  (after the skip: it names transformers models)

pytestmark = pytest.mark.gloo

STEPS = 5


def _train(model, batches, lay_out=lambda t: t, observe=False):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, found = [], Explanation()
    for batch in batches:
        phase = {"backward": False}
        found = Explanation()
        batch = {k: lay_out(v) for k, v in batch.items()}  # (not counted: a dense model's batch moves alike)
        with comm.observing(recorder(found, phase)) if observe else _nothing():
            loss = model(**batch).loss
            optimizer.zero_grad()
            phase["backward"] = True
            loss.backward()
        optimizer.step()
        losses.append(loss.item())
    grads = {n: p.grad for n, p in model.named_parameters()}
    grads = {n: st.full_tensor(g) if isinstance(g, st.GlobalTensor) else g for n, g in grads.items()}
    return losses, grads, found


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False


def _train_job(name, implementation, layout, rows):
    batches = moe_models.batches(STEPS, rows)
    want, want_grads, _ = _train(moe_models.make(name, implementation), batches)
    model = moe_models.make(name, implementation)
    lay = moe_models.lay_out(model, moe_models.LAYOUTS[layout])
    got, got_grads, found = _train(model, batches, lay, observe=True)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    grad_error = max(
        ((got_grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-3)).item() for n, g in want_grads.items()
    )
    kinds = collections.Counter(
        (c.kind, c.backward, "expert" if "expert parallelism" in c.cause else "") for c in found
    )
    gathered = [c.cause for c in found if "gather" in c.kind]
    return worst, grad_error, dict(kinds), gathered


CASES = [
    ("mixtral", "grouped_mm", "DP"),
    ("mixtral", "grouped_mm", "EP"),
    ("mixtral", "grouped_mm", "DP x EP"),
    ("mixtral", "eager", "EP"),
    ("qwen3_moe", "grouped_mm", "DP"),
    ("qwen3_moe", "grouped_mm", "EP"),
    ("qwen3_moe", "eager", "DP x EP"),
]


@pytest.mark.parametrize("name, implementation, layout", CASES)
def test_moe_trains_like_one_process(name, implementation, layout):
    # 8 rows: every rank holds 2 sequences; the routing leaves some experts without tokens on some ranks
    for worst, grad_error, kinds, gathered in run_on_world(4, _train_job, name, implementation, layout, 8):
        assert worst < 1e-5, worst
        assert grad_error < 1e-4, grad_error
        assert not gathered, gathered  # neither routing nor an expert weight is gathered
        layers = 2
        if layout == "DP":
            assert set(k for k, _, _ in kinds) == {"all-reduce(sum)"}, kinds
        else:  # counts, dispatch and combine forward; the reverse of dispatch and combine backward
            assert kinds[("all-to-all", False, "expert")] == 3 * layers, kinds
            assert kinds[("all-to-all", True, "expert")] == 2 * layers, kinds
            assert sum(n for (k, _, _), n in kinds.items() if k == "all-to-all") == 5 * layers, kinds


def _uneven_job():
    """Six rows on four ranks: parts of 2, 2, 1, 1 sequences."""
    batches = moe_models.batches(STEPS, 6)
    want, _, _ = _train(moe_models.make("mixtral"), batches)
    model = moe_models.make("mixtral")
    got, _, _ = _train(model, batches, moe_models.lay_out(model, moe_models.LAYOUTS["EP"]))
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def test_moe_uneven_batch():
    assert max(run_on_world(4, _uneven_job)) < 1e-5


def _experts_job(layout_name):
    """An experts module alone, with a routing chosen so that expert 1 receives no token and the tokens of rank 0
    (rows 0 and 1) all go to experts 2 and 3, which ranks 2 and 3 hold."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=8, intermediate_size=4, num_local_experts=4)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    reference = MixtralExperts(config)
    torch.nn.init.normal_(reference.gate_up_proj)
    torch.nn.init.normal_(reference.down_proj)
    model = MixtralExperts(config)
    model.load_state_dict(reference.state_dict())
    hidden = torch.randn(8, 8)
    index = torch.tensor([[2, 3], [3, 2], [0, 2], [0, 3], [2, 0], [3, 0], [0, 2], [2, 3]])
    weights = torch.rand(8, 2)
    h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
    gen = torch.Generator().manual_seed(3)
    upstream = torch.randn(8, 8, generator=gen)
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
    return out.sbp, max((st.full_tensor(a) - b).abs().max().item() for a, b in pairs)


@pytest.mark.parametrize("layout_name", ["EP", "DP", "tokens broadcast"])
def test_experts_module_with_empty_experts_and_ranks(layout_name):
    for sbp, error in run_on_world(4, _experts_job, layout_name):
        assert error < 1e-5, error
        assert sbp == ((partial_sum,) if layout_name == "tokens broadcast" else (split(0),))


def _local_map_job():
    p = st.placement("cpu", [0, 1, 2, 3])
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 3, generator=gen), torch.randn(3, 4, generator=gen)
    ref_x, ref_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    (ref_x @ ref_w).tanh().sum().backward()

    gx = st.to_global(x, p, broadcast).to_global(sbp=split(0)).detach().requires_grad_()
    gw = st.to_global(w, p, broadcast).detach().requires_grad_()
    # rows of x are uneven (2, 2, 2, 1): without out_shapes the ranks agree on them
    rows = st.local_map(lambda a, b: (a @ b).tanh(), (split(0), broadcast), split(0))
    out = rows(gx, gw)
    total = st.local_map(lambda a: a.sum(), (split(0),), partial_sum, out_shapes=lambda a: [()])(out)
    total.backward()
    errors = [
        (st.full_tensor(out) - (x @ w).tanh()).abs().max().item(),
        (st.full_tensor(gx.grad) - ref_x.grad).abs().max().item(),
        (st.full_tensor(gw.grad) - ref_w.grad).abs().max().item(),
        abs(total.full_tensor().item() - (x @ w).tanh().sum().item()),
    ]
    refusals = []
    for call in (
        lambda: st.local_map(lambda a: a * 2, (split(0),), broadcast)(gx),  # a broadcast output of per-rank work
        lambda: st.local_map(lambda a: a * 2, (partial_sum,), partial_sum)(gw.to_global(sbp=partial_sum)),
        lambda: st.local_map(lambda a: a, (split(0),), split(0), out_shapes=lambda a: [(7, 4)])(gx),
    ):
        try:
            call()
            refusals.append(None)
        except ValueError as err:
            refusals.append(str(err))
    return max(errors), out.sbp, total.sbp, gw.grad.sbp, refusals


def test_local_map_against_one_process():
    for error, out_sbp, total_sbp, grad_sbp, refusals in run_on_world(4, _local_map_job):
        assert error < 1e-5, error
        assert out_sbp == (split(0),) and total_sbp == (partial_sum,)
        assert grad_sbp == (partial_sum,)  # each rank's share; Module.to_global would reduce it
        assert "declare it split" in refusals[0]
        assert "no gradient with respect to the sum" in refusals[1]
        assert "has a part of shape" in refusals[2]


def _explain_job():
    model = moe_models.make("mixtral")
    lay = moe_models.lay_out(model, moe_models.LAYOUTS["EP"])
    batch = moe_models.batches(1, 8)[0]
    found = st.explain(lambda b: model(**{k: lay(v) for k, v in b.items()}).loss, batch)
    return [(c.kind, c.bytes, c.backward) for c in found if "expert parallelism" in c.cause], str(found)


def test_explain_lists_data_dependent_exchanges():
    for exchanges, text in run_on_world(4, _explain_job):
        dependent = [e for e in exchanges if e[1] is None]
        assert len(dependent) == 2 * (2 + 2), exchanges  # per layer: dispatch and combine, forward and backward
        assert "data-dependent" in text
