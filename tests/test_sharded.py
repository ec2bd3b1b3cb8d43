"""Sharded data parallelism (``Module.to_global(..., shard=axis)``) against one process: parameters stored split
over the data axis, gathered per unit on use, freed after, gradients reduce-scattered."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import sbp_torch as st
from sbp_torch._layout import balanced_sizes
from sbp_torch.sbp import broadcast, partial_sum, split

from world import run_on_world

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

pytestmark = pytest.mark.gloo


class Blocks(nn.Module):
    """An input layer, three residual blocks in a ModuleList (the default units), a head; odd sizes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, 10)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(10, 10), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(10, 3)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _batches(n=3, rows=7):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 6, generator=gen), torch.randn(rows, 3, generator=gen)) for _ in range(n)]


def _live_gathered_bytes(model) -> int:
    """Bytes held by the gathered copies of every unit of a sharded model (what the test counts)."""
    units = model._sbp_torch_sharded.units
    return sum(p.full.untyped_storage().nbytes() for u in units for p in u.params if p.full is not None)


def _sharded_job(mixed_precision=None):
    p = st.placement.all("cpu")
    reference = Blocks()
    model = copy.deepcopy(reference).to_global(p, broadcast, shard=0, mixed_precision=mixed_precision)
    seen = {"while_block_runs": [], "dtype_in_use": set(), "eager": True}

    def on_block(module, args):  # (after the unit's own pre-hook) another block's copy alive: one not freed
        if not seen["eager"]:
            return
        block_bytes = sum(q.numel() * q.element_size() for q in module.parameters())
        seen["while_block_runs"].append(_live_gathered_bytes(model) - block_bytes)
        seen["dtype_in_use"].add(str(module[0].weight.dtype))

    for block in model.blocks:
        block.register_forward_pre_hook(on_block)
    layout = lambda t: t.to_global(p, broadcast).to_global(sbp=split(0))  # noqa: E731
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=0.01, foreach=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)
    want, got, after_forward = [], [], []
    for x, y in _batches():
        loss = nn.functional.mse_loss(reference(x), y)
        opt_ref.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        opt_ref.step()
        want.append(loss.item())
        loss = nn.functional.mse_loss(model(layout(x)), layout(y))
        after_forward.append(_live_gathered_bytes(model))
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # on the stored (split) gradients
        opt.step()
        got.append(loss.item())
    seen["eager"] = False  # explain traces: no copies, each use a conversion
    collectives = st.explain(lambda a, b: nn.functional.mse_loss(model(a), b), *map(layout, _batches(1)[0]))
    return {
        "want": want,
        "got": got,
        "params": [(a.detach(), b.full_tensor().detach()) for a, b in zip(reference.parameters(), model.parameters())],
        "local_rows": [q.to_local().shape[0] for q in model.parameters()],
        "storage_bytes": sum(q._local.untyped_storage().nbytes() for q in model.parameters()),
        "rows": [q.shape[0] for q in model.parameters()],
        "grad_sbps": {q.grad.sbp for q in model.parameters()},
        "grad_dtypes": {q.grad.dtype for q in model.parameters()},
        "after_forward": after_forward,
        "seen": seen,
        "report": st.memory_report(model, opt),
        "block_bytes": sum(q.numel() * 4 for q in reference.blocks[0].parameters()),
        "root_bytes": sum(q.numel() * 4 for n, q in reference.named_parameters() if not n.startswith("blocks")),
        "collectives": collectives.counts(),
    }


@pytest.mark.parametrize("world", [3])
def test_sharded_data_parallel_trains_like_one_process_and_frees_what_it_gathers(world):
    """Uneven parts over 3 ranks, AdamW (foreach) and clip_grad_norm_."""
    results = run_on_world(world, _sharded_job)
    for rank, r in enumerate(results):
        torch.testing.assert_close(torch.tensor(r["got"]), torch.tensor(r["want"]), rtol=1e-5, atol=1e-6)
        for a, b in r["params"]:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        # stored: this rank's balanced part of dim 0 (uneven over 3 ranks); gradients laid out alike
        assert r["local_rows"] == [balanced_sizes(n, world)[rank] for n in r["rows"]]
        assert r["grad_sbps"] == {(split(0),)}
        # no block's gathered copy outlives its forward; the root's is kept for the backward that follows
        assert r["after_forward"] == [r["root_bytes"]] * 3
        assert set(r["seen"]["while_block_runs"]) == {r["root_bytes"]}
        report = r["report"]
        assert report.parameters < sum(b.numel() * 4 for _, b in r["params"]) / world + 4 * 64
        assert r["storage_bytes"] == report.parameters  # no stored part is a view that keeps the whole alive
        assert report.gradients == report.parameters and report.optimizer_state >= 2 * report.parameters
        assert report.gathered_peak == r["root_bytes"] + r["block_bytes"]
        # explain lists the gathers and the gradient reduce-scatters, and no all-reduce of gradients
        assert r["collectives"].get("all-gather", 0) > 0 and r["collectives"].get("reduce-scatter(sum)", 0) > 0
        assert not any(kind.startswith("all-reduce") for kind in r["collectives"])


def test_mixed_precision_gathers_in_bfloat16_and_keeps_float32_state():
    policy = st.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    for r in run_on_world(2, _sharded_job, policy):
        assert r["seen"]["dtype_in_use"] == {"torch.bfloat16"}
        assert r["grad_dtypes"] == {torch.float32}
        # bfloat16 compute: the losses follow float32's to within bfloat16's precision
        torch.testing.assert_close(torch.tensor(r["got"]), torch.tensor(r["want"]), rtol=3e-2, atol=1e-2)


def _frozen_job():
    """Two parameters frozen after the first step and unfrozen after the third, in one process and sharded."""
    p = st.placement.all("cpu")
    reference = Blocks()
    model = copy.deepcopy(reference).to_global(p, broadcast, shard=0)
    layout = lambda t: t.to_global(p, broadcast).to_global(sbp=split(0))  # noqa: E731
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (reference, model)]
    grads_while_frozen = []
    for step, (x, y) in enumerate(_batches(5)):
        for m in (reference, model):
            for q in (m.blocks[0][0].weight, m.head.bias):
                q.requires_grad_(step not in (1, 2))
        for m, optimizer, to_input in zip((reference, model), optimizers, (lambda t: t, layout)):
            nn.functional.mse_loss(m(to_input(x)), to_input(y)).backward()
            if m is model and step in (1, 2):
                grads_while_frozen += [m.blocks[0][0].weight.grad, m.head.bias.grad]
            optimizer.step()
            optimizer.zero_grad()
        for a, b in zip(reference.parameters(), model.parameters()):
            torch.testing.assert_close(b.full_tensor(), a.detach(), rtol=1e-5, atol=1e-6, msg=f"step {step}")
    assert grads_while_frozen == [None] * 4


def test_a_frozen_parameter_is_neither_given_a_gradient_nor_updated():
    run_on_world(3, _frozen_job)


def _gpt_2x2_job(checkpointing: bool, shard: int | None = 0):
    import gpt

    torch.manual_seed(0)
    reference = gpt.GPT(2)
    model = copy.deepcopy(reference)
    want = gpt.train(reference, 3)
    placement, plan, batch_sbp = gpt.plans(4)["dp_tp"]
    model.to_global(placement, plan, shard=shard)
    if checkpointing:
        blocks = list(model.blocks)

        def forward(x):
            for block in blocks:
                x = checkpoint(block, x, use_reentrant=False)
            return x

        model.blocks.forward = forward
    layout = lambda t: t.to_global(placement, (broadcast, broadcast)).to_global(sbp=batch_sbp)  # noqa: E731
    return want, gpt.train(model, 3, layout)


@pytest.mark.parametrize(
    "checkpointing,shard",
    [(False, 0), (True, 0), (True, None)],
    ids=["sharded", "sharded-activation-checkpointing", "replicated-activation-checkpointing"],
)
def test_data_parallel_with_tensor_parallel_on_2x2_trains_gpt_like_one_process(checkpointing, shard):
    """Sharded or not; activation checkpointing recomputes the blocks in backward as their forward ran."""
    for want, got in run_on_world(4, _gpt_2x2_job, checkpointing, shard):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)


def _reshard_job(path: str):
    p = st.placement.all("cpu")
    reference = Blocks()
    x, y = _batches(1)[0]
    layout = lambda t: t.to_global(p, broadcast).to_global(sbp=split(0))  # noqa: E731

    def trained(model):
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        nn.functional.mse_loss(model(layout(x)), layout(y)).backward()
        opt.step()
        return opt

    full = lambda m: [q.detach().full_tensor() for q in m.parameters()]  # noqa: E731
    out = {}
    for source, target in [("sharded", "replicated"), ("replicated", "sharded")]:
        make = {"sharded": {"shard": 0}, "replicated": {}}
        saved = copy.deepcopy(reference).to_global(p, broadcast, **make[source])
        opt = trained(saved)
        st.checkpoint.save({"model": saved, "optim": opt}, f"{path}/{source}")
        loaded = Blocks().to_global(p, broadcast, **make[target])
        loaded_opt = torch.optim.AdamW(loaded.parameters(), lr=0.01)
        st.checkpoint.load({"model": loaded, "optim": loaded_opt}, f"{path}/{source}")
        moments = [(a["exp_avg"].full_tensor(), b["exp_avg"].full_tensor())
                   for a, b in zip(opt.state.values(), loaded_opt.state.values())]  # fmt: skip
        out[source] = (list(zip(full(saved), full(loaded))), moments, [q.sbp for q in loaded.parameters()])
    return out


def test_a_sharded_checkpoint_loads_replicated_and_back(tmp_path):
    for result in run_on_world(2, _reshard_job, str(tmp_path)):
        for source, (params, moments, sbps) in result.items():
            for a, b in params + moments:
                assert torch.equal(a, b), source
            assert set(sbps) == ({(broadcast,)} if source == "sharded" else {(split(0),)})


def _bad_input_job():
    p = st.placement.all("cpu")
    errors = []
    for kwargs in [
        {"sbp": {"head.weight": partial_sum}, "shard": 0},
        {"shard": 1},
        {"mixed_precision": st.MixedPrecision(param_dtype=torch.bfloat16)},
    ]:
        try:
            Blocks().to_global(p, kwargs.pop("sbp", broadcast), **kwargs)
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_bad_sharding_input_is_refused_at_to_global_naming_the_problem():
    for errors in run_on_world(2, _bad_input_job):
        assert len(errors) == 3
        assert "head.weight" in errors[0] and "partial" in errors[0]
        assert "shard must be a placement axis" in errors[1]
        assert "give shard=" in errors[2]


def _cast_backward_job():
    import warnings

    p = st.placement.all("cpu")
    x = torch.arange(10.0).reshape(5, 2).to_global(p, broadcast).to_global(sbp=split(0)).requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (x.to(torch.bfloat16).float() * 3).sum().backward()
    return [str(w.message) for w in caught], x.grad.full_tensor()


def test_the_backward_of_a_cast_runs_on_the_parts():
    """The mixed-precision casts' backward (``.to`` naming the device) is decided, not run on gathered inputs."""
    for messages, grad in run_on_world(2, _cast_backward_job):
        assert not [m for m in messages if "gathered" in m]
        assert torch.equal(grad, torch.full((5, 2), 3.0))
