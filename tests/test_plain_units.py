"""Units that run as plain PyTorch (``_api/_plain_units.py``) against one process: random uneven batches, world sizes,
layouts (data parallel, sharded, tensor parallel), blocks that read a value or write a buffer, activation
checkpointing; which units run plain, and why the others stay on the dispatcher's path."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st_
from torch import nn
from torch.utils.checkpoint import checkpoint

import sbp_torch as st
from sbp_torch._api._plain_units import plain_units_of
from sbp_torch.sbp import broadcast, split

from world import run_on_world

pytestmark = pytest.mark.gloo

STEPS = 4  # the first call of a key takes the dispatcher's path, the second learns, the third on run plain


class Block(nn.Module):
    """A residual MLP block on ``[rows, width]``, with a view of its hidden state, and what ``kind`` adds: a
    branch on a value (``reads``) or a counter buffer written each call (``writes``)."""

    def __init__(self, width: int, kind: str):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.kind = kind
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x, scale: float = 1.0):
        h = nn.functional.gelu(self.up(self.norm(x)))
        h = h.view(*h.shape[:-1], 2, -1).transpose(-1, -2).reshape(h.shape)  # (sizes made local by the dispatcher)
        h = self.down(h) * scale + x.new_zeros(x.shape[0], 1)  # (a buffer of the rows: sizes made local too)
        if self.kind == "reads" and h.sum() > 0:
            h = h * 0.5
        if self.kind == "writes":
            self.calls.add_(1)
        return x + h


class Net(nn.Module):
    def __init__(self, width: int, kind: str, checkpointed: bool):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, width)
        self.blocks = nn.ModuleList(Block(width, kind) for _ in range(2))
        self.head = nn.Linear(width, 1)
        self.checkpointed = checkpointed

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = checkpoint(block, h, 0.5, use_reentrant=False) if self.checkpointed else block(h, scale=0.5)
        return self.head(h)


_TENSOR_PARALLEL = {"*.up.weight": split(0), "*.up.bias": split(0), "*.down.weight": split(1)}


def _job(case: dict):
    p = st.placement.all("cpu")
    reference = Net(case["width"], case["kind"], case["checkpointed"])
    model = copy.deepcopy(reference)
    layout = case["layout"]
    model.to_global(p, _TENSOR_PARALLEL if layout == "tensor" else broadcast, shard=0 if layout == "sharded" else None)
    gen = torch.Generator().manual_seed(case["seed"])
    batches = [(torch.randn(case["rows"], 3, generator=gen), torch.randn(case["rows"], 1, generator=gen))]
    batches *= STEPS  # (one shape: one key per unit)
    lay_out = lambda t: t.to_global(p, broadcast).to_global(sbp=split(0))  # noqa: E731
    want, got = [], []
    for net, out, lay in ((reference, want, lambda t: t), (model, got, lay_out)):
        optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
        for x, y in batches:
            loss = nn.functional.mse_loss(net(lay(x)), lay(y))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            out.append(loss.item())
    units = plain_units_of(model)
    x = lay_out(batches[0][0])
    # traced, the dispatcher's path (explain cannot read a value)
    collectives = {} if case["kind"] == "reads" else st.explain(lambda a: model(a).sum(), x).counts()
    return {
        "want": want,
        "got": got,
        "params": [(a.detach(), b.full_tensor().detach()) for a, b in zip(reference.parameters(), model.parameters())],
        "plain": [u.plain_keys() for u in units],
        "refusals": [r for u in units for r in u.refusals],
        "collectives": collectives,
    }


def _cases(world: int):
    return st_.fixed_dictionaries(
        {
            "rows": st_.integers(world - 1, 3 * world + 1),  # mostly uneven; a rank with no rows, too
            "width": st_.sampled_from([4, 6]),
            "kind": st_.sampled_from(["plain", "plain", "reads", "writes"]),
            "layout": st_.sampled_from(["data", "sharded", "tensor"]),
            "checkpointed": st_.booleans(),
            "seed": st_.integers(0, 100),
        }
    )


@pytest.mark.parametrize("world", [3])
def test_units_run_plain_where_nothing_communicates_and_train_like_one_process(world):
    # (no shrinking: each example runs on a world; the case is printed whole)
    @settings(
        max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate]
    )
    @given(_cases(world))
    # a rank with no rows, whose replay alone raises: the ranks agree to stay on the dispatcher's path
    @example({"rows": world - 1, "width": 4, "kind": "plain", "layout": "data", "checkpointed": False, "seed": 0})
    def check(case):
        for r in run_on_world(world, _job, case):
            torch.testing.assert_close(torch.tensor(r["got"]), torch.tensor(r["want"]), rtol=1e-5, atol=1e-6)
            for a, b in r["params"]:
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
            # (a rank with no rows cannot view them as (0, 2, -1): there every rank stays on the dispatcher's path)
            plain = case["kind"] == "plain" and case["layout"] != "tensor" and case["rows"] >= world
            assert r["plain"] == [1, 1] if plain else r["plain"] == [0, 0], (case, r["refusals"])
            if case["layout"] == "tensor" or case["kind"] == "reads":
                assert all("collective" in why for why in r["refusals"]), r["refusals"]
            elif case["rows"] < world and case["kind"] == "plain":
                assert r["refusals"], r["refusals"]
            elif case["kind"] == "writes":
                assert all("wrote into" in why for why in r["refusals"]), r["refusals"]
            # explain traces the dispatcher's path: every collective is still listed
            listed = [kind for kind in r["collectives"] if kind.startswith(("all-reduce", "all-gather"))]
            assert case["kind"] == "reads" or listed, r["collectives"]

    check()


def _cache_job():
    """A block called with an object it could fill with parts (a key/value cache) stays on the dispatcher's path."""

    class Cache:
        def __init__(self):
            self.kept = []

    class Keeping(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, cache=None):
            y = self.lin(x)
            if cache is not None:
                cache.kept.append(y)
            return y

    p = st.placement.all("cpu")
    model = nn.Sequential(Keeping(), Keeping()).to_global(p, broadcast)
    x = torch.randn(5, 4).to_global(p, broadcast).to_global(sbp=split(0))
    caches = []
    for _ in range(STEPS):
        caches.append(Cache())
        model[1](model[0](x), cache=caches[-1])
    plain = [u.plain_keys() for u in plain_units_of(model)]
    model[0].lin.register_forward_hook(lambda m, a, out: None)  # (a new key: it would see plain parts)
    for _ in range(STEPS):
        model[0](x)
    return {
        "kept_global": all(type(t).__name__ == "GlobalTensor" for c in caches for t in c.kept),
        "plain": plain,
        "hooked": plain_units_of(model)[0].refusals,
    }


def test_an_argument_the_unit_could_fill_or_a_hook_inside_keeps_it_on_the_dispatchers_path():
    for r in run_on_world(2, _cache_job):
        assert r["kept_global"]
        assert r["plain"] == [1, 0]  # the block without the object runs plain
        assert r["hooked"] and "hook" in r["hooked"][-1]


def _moe_job():
    """A transformers MoE model (Mixtral, the experts' Python loop over the experts hit), sharded data parallel, trained
    four steps."""
    import zoo.moe as moe
    from zoo.training import train

    models = []
    for _ in range(2):
        model = moe.make("mixtral", "eager")
        model.config.use_cache = False  # (a key/value cache is an object the blocks would fill: see _cache_job)
        models.append(model)
    reference, model = models
    p = st.placement.all("cpu")
    model.to_global(p, broadcast, shard=0)
    batches = moe.batches(STEPS, 6)  # (even: uneven rows flattened with the sequence are re-balanced, an exchange)
    got, got_grads = train(model, batches, lambda t: t.to_global(p, broadcast).to_global(sbp=split(0)))
    want, want_grads = train(reference, batches)
    units = plain_units_of(model)
    return {
        "got": got,
        "want": want,
        "grads": [(want_grads[name], got_grads[name]) for name in want_grads],
        "plain": [u.plain_keys() for u in units],
        "refusals": [r for u in units for r in u.refusals],
    }


def test_transformers_moe_blocks_run_plain_in_sharded_data_parallel():
    """Every decoder layer runs plain on its gathered weights, its experts (whose tokens stay on their rank) inside,
    each rank reaching every expert's weights although its tokens reach only some."""
    pytest.importorskip("transformers")
    for r in run_on_world(2, _moe_job):
        torch.testing.assert_close(torch.tensor(r["got"]), torch.tensor(r["want"]), rtol=1e-5, atol=1e-6)
        for want, got in r["grads"]:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert r["plain"] and all(n == 1 for n in r["plain"]), r["refusals"]


def _recompute_job():
    """One unit called four times in each forward, each call checkpointed (the first on the batch, which needs no
    gradient, a key of its own): of the others, the first takes the dispatcher's path, the second learns, the third
    runs plain, and backward recomputes each on the path it took."""

    class Repeated(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.block = Block(4, "plain")

        def forward(self, x):
            for _ in range(4):
                x = checkpoint(self.block, x, 0.5, use_reentrant=False)
            return x

    p = st.placement.all("cpu")
    reference = Repeated()
    model = copy.deepcopy(reference).to_global(p, broadcast, units=["block"])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, generator=gen)
    want, got = [], []
    for net, out, lay in (
        (reference, want, lambda t: t),
        (model, got, lambda t: t.to_global(p, broadcast).to_global(sbp=split(0))),
    ):
        for _ in range(2):
            net.zero_grad()
            loss = net(lay(x)).pow(2).mean()
            loss.backward()
            out.append(
                (
                    loss.item(),
                    [q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad for q in net.parameters()],
                )
            )
    try:  # double backward through a plain unit: refused, not its second-order terms dropped
        loss = model(x.to_global(p, broadcast).to_global(sbp=split(0))).pow(2).mean()
        torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        double = "no error"
    except RuntimeError as err:
        double = str(err)
    return {"want": want, "got": got, "plain": plain_units_of(model)[0].plain_keys(), "double": double}


def test_a_recomputed_forward_takes_the_path_its_forward_took_and_double_backward_is_refused():
    for r in run_on_world(2, _recompute_job):
        assert r["plain"] == 1
        for (want_loss, want_grads), (got_loss, got_grads) in zip(r["want"], r["got"]):
            torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
            for a, b in zip(want_grads, got_grads):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        assert "create_graph" in r["double"], r["double"]
