"""``nn.Module.to_global`` and unmodified torch optimizers on global parameters, against one process."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer
from torch.utils import _foreach_utils

import sbp_torch as st
from sbp_torch import _comm as comm
from sbp_torch.sbp import broadcast, split

from strict_check import recording_collectives
from world import run_on_world

pytestmark = pytest.mark.gloo

OPTIMIZERS = {
    "sgd": lambda ps, foreach: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=foreach),
    "adam": lambda ps, foreach: torch.optim.Adam(ps, lr=0.01, foreach=foreach),
    "adamw": lambda ps, foreach: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=foreach),
}


# The rest of torch's optimizers, each with the options that take its most foreach ops
MORE_OPTIMIZERS = {
    "nadam": lambda ps, fe: torch.optim.NAdam(ps, lr=0.01, weight_decay=0.1, decoupled_weight_decay=True, foreach=fe),
    "radam": lambda ps, fe: torch.optim.RAdam(ps, lr=0.01, weight_decay=0.1, foreach=fe),
    "adamax": lambda ps, fe: torch.optim.Adamax(ps, lr=0.01, weight_decay=0.1, foreach=fe),
    "asgd": lambda ps, fe: torch.optim.ASGD(ps, lr=0.01, weight_decay=0.1, foreach=fe),
    "rprop": lambda ps, fe: torch.optim.Rprop(ps, lr=0.01, foreach=fe),
    "adagrad": lambda ps, fe: torch.optim.Adagrad(ps, lr=0.1, weight_decay=0.1, foreach=fe),
    "adadelta": lambda ps, fe: torch.optim.Adadelta(ps, lr=1.0, weight_decay=0.1, foreach=fe),
    "rmsprop": lambda ps, fe: torch.optim.RMSprop(ps, lr=0.01, momentum=0.9, centered=True, foreach=fe),
    "amsgrad": lambda ps, fe: torch.optim.Adam(ps, lr=0.01, amsgrad=True, foreach=fe),
    "nesterov": lambda ps, fe: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1, foreach=fe),
}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 3))


def _train(model, batches, optimizer, to_input=lambda x: x):
    losses = []
    for x, y in batches:
        loss = nn.functional.mse_loss(model(to_input(x)), to_input(y))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


def _batches(n=3, rows=7):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 6, generator=gen), torch.randn(rows, 3, generator=gen)) for _ in range(n)]


def _compare_training(plan, input_sbp, optimizer_name, foreach, mesh, bucket_mb=25.0):
    p = st.placement("cpu", mesh)
    reference = _mlp()
    model = copy.deepcopy(reference).to_global(p, plan, bucket_mb=bucket_mb)
    want = _train(reference, _batches(), OPTIMIZERS[optimizer_name](reference.parameters(), foreach))
    got = _train(
        model,
        _batches(),
        OPTIMIZERS[optimizer_name](model.parameters(), foreach),
        lambda t: t.to_global(p, (broadcast,) * p.ndim).to_global(sbp=input_sbp),
    )
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    metas = [b._meta for b in model.parameters()]
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.full_tensor(), a.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert b.grad.sbp == st.gradient_sbp(b.sbp), name
        # equal metadata is one object (the optimizer's cached calls then compare keys by identity), the reduced
        # gradient's included
        assert all(m is b._meta for m in metas if m == b._meta), name
        assert b.grad._meta is b._meta or b.grad._meta != b._meta, name
    return [b.sbp for b in model.parameters()]


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("foreach", [False, True])
def test_data_parallel_training_matches_one_process(optimizer_name, foreach):
    run_on_world(3, _compare_training, broadcast, split(0), optimizer_name, foreach, [0, 1, 2])


def _every_optimizer() -> None:
    """Each optimizer of ``MORE_OPTIMIZERS``, foreach and per tensor, on a tensor-parallel model with uneven parts,
    against the per-tensor optimizer on one process; and torch's defaults pick the foreach paths for global tensors
    wherever they pick them for plain ones."""
    p = st.placement("cpu", [0, 1, 2])
    plan = {"0.weight": split(0), "0.bias": split(0), "2.weight": split(1)}  # 10 rows or columns over 3 ranks
    for name, make in MORE_OPTIMIZERS.items():
        reference = _mlp()
        want = _train(reference, _batches(), make(reference.parameters(), False))
        for foreach in (False, True):
            model = _mlp().to_global(p, plan)
            got = _train(model, _batches(), make(model.parameters(), foreach), lambda t: t.to_global(p, broadcast))
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6, msg=name)
            for a, b in zip(reference.parameters(), model.parameters()):
                torch.testing.assert_close(b.full_tensor(), a.detach(), rtol=1e-5, atol=1e-6, msg=name)
    params, grads = list(model.parameters()), [b.grad for b in model.parameters()]
    # (on this CPU machine torch defaults to foreach optimizers only where it would on a GPU: pretend it is one)
    with mock.patch.object(torch_optimizer, "_get_foreach_kernels_supported_devices", lambda: ["cpu"]):
        assert torch_optimizer._default_to_fused_or_foreach(params, False) == (False, True)
    assert _foreach_utils._has_foreach_support(grads, torch.device("cpu"))  # (clip_grad_norm_'s)


def test_every_optimizer_of_torch_with_and_without_foreach_matches_one_process():
    run_on_world(3, _every_optimizer)


def test_tensor_parallel_plan_by_patterns():
    plan = {"0.weight": split(0), "0.bias": split(0), "2.weight": split(1), "*": broadcast}
    sbps = run_on_world(2, _compare_training, plan, broadcast, "adamw", False, [0, 1])[0]
    assert sbps == [(split(0),), (split(0),), (split(1),), (broadcast,)]


def _hybrid_plan(name, tensor):
    """Data parallel on mesh axis 0, Megatron-style tensor parallel on axis 1."""
    if name.startswith("0."):
        return (broadcast, split(0))
    return (broadcast, split(1)) if name == "2.weight" else (broadcast, broadcast)


def test_hybrid_plan_on_mesh():
    run_on_world(4, _compare_training, _hybrid_plan, (split(0), broadcast), "adam", True, [[0, 1], [2, 3]])


def _all_reduce_starts(mesh, input_sbp, optimizer_name, foreach, bucket_mb) -> tuple[int, int, set]:
    """``_compare_training``, counting the gradient all-reduces that start while backward still runs (inside a
    parameter's accumulation hook) and those that start after it (the end-of-backward callback); and the sizes of
    the groups they start on."""
    starts, sizes = [], set()
    original = comm.start_all_reduce

    def recording(flat, op, group):
        starts.append(torch._C._current_autograd_node() is not None)
        sizes.add(group.size)
        return original(flat, op, group)

    comm.start_all_reduce = recording
    try:
        _compare_training((broadcast,) * len(input_sbp), input_sbp, optimizer_name, foreach, mesh, bucket_mb)
    finally:
        comm.start_all_reduce = original
    return sum(starts), len(starts) - sum(starts), sizes


@pytest.mark.parametrize(
    "mesh,input_sbp,optimizer_name,foreach",
    [
        ([0, 1, 2], (split(0),), "sgd", False),
        ([[0, 1], [2, 3]], (split(0), split(0)), "adamw", True),
        ([[0, 1]], (split(0), split(0)), "adam", False),
    ],
    ids=["3 ranks", "2x2 mesh", "1x2 mesh"],
)
def test_buckets_reduce_during_backward(mesh, input_sbp, optimizer_name, foreach):
    """Buckets of one tensor each start their all-reduce while backward goes on (and on a mesh, the second
    axis follows when they finish); one bucket for all starts when backward ends. None starts on an axis of one
    rank, where the part already holds the sum. The values match one process either way (``_compare_training``)."""
    world = sum(map(len, mesh)) if isinstance(mesh[0], list) else len(mesh)
    steps, params = len(_batches()), len(list(_mlp().parameters()))
    during, after, sizes = run_on_world(world, _all_reduce_starts, mesh, input_sbp, optimizer_name, foreach, 1e-6)[0]
    assert (during, after) == (steps * params, 0)
    assert 1 not in sizes
    during, after, sizes = run_on_world(world, _all_reduce_starts, mesh, input_sbp, optimizer_name, foreach, 25.0)[0]
    assert (during, after) == (0, steps)


def _sharded_data_parallel(mesh, input_sbp, bucket_mb):
    """``_compare_training`` with every parameter split on the first axis (ZeRO / FSDP style), counting the
    reduce-scatters that gradient reduction runs."""
    with recording_collectives("reduce_scatter", "start_reduce_scatter_parts") as calls:
        _compare_training(split(0), input_sbp, "adamw", True, mesh, bucket_mb)
    return len(calls)


@pytest.mark.parametrize("mesh,input_sbp", [([0, 1, 2], split(0)), ([0, 1], split(0))])
def test_sharded_parameters_reduce_scatter_their_gradients_in_buckets(mesh, input_sbp):
    """Split parameters used by split batches get partial gradients, reduce-scattered to their split (uneven
    on 3 ranks): one collective for all of them per step when they fit one bucket, one each with tiny ones."""
    world = len(mesh)
    bucketed = run_on_world(world, _sharded_data_parallel, mesh, input_sbp, 25.0)
    one_each = run_on_world(world, _sharded_data_parallel, mesh, input_sbp, 1e-6)
    for together, alone in zip(bucketed, one_each):
        assert together < alone, (together, alone)


def _held_gradients(micro_batches: int):
    """Data parallel on 3 ranks (uneven rows), gradients kept between steps (``zero_grad(set_to_none=False)``) and
    accumulated over micro-batches, against one process; and the all-reduces of the steps by cause."""
    p = st.placement("cpu", [0, 1, 2])
    reference = _mlp()
    model = copy.deepcopy(reference).to_global(p)
    causes: list[str] = []

    def train(net, lay_out=lambda t: t):
        optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
        losses = []
        for x, y in _batches():
            for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
                loss = nn.functional.mse_loss(net(lay_out(xs)), lay_out(ys)) / micro_batches
                loss.backward()
                losses.append(float(loss))
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        return losses

    want = train(reference)
    note = lambda kind, group, nbytes: causes.append(f"{kind}: {comm.cause()}")  # noqa: E731
    with comm.observing(note):
        got = train(model, lambda t: t.to_global(p, broadcast).to_global(sbp=split(0)))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(b.full_tensor(), a.detach(), rtol=1e-5, atol=1e-6)
    return [c for c in causes if c.startswith("all-reduce")]


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_gradients_held_between_steps_are_accumulated_locally_and_reduced_in_one_bucket(micro_batches):
    """A held gradient (zeroed in place, or an earlier micro-batch's, reduced) takes the arriving gradient's partial
    layout before the add, so each backward reduces its parameters' sum once, in one bucket, not each gradient
    apart before accumulating it."""
    reductions = run_on_world(3, _held_gradients, micro_batches)[0]
    steps, params = len(_batches()), len(list(_mlp().parameters()))
    gradients = [c for c in reductions if "gradient reduction" in c]
    assert len(gradients) == steps * micro_batches < steps * micro_batches * params
    assert not [c for c in reductions if "add" in c], reductions


def _backward_that_raises(bucket_mb):
    """A backward that raises midway (a hook on an activation, after the last layer's gradients have gone into
    a bucket), caught by the user, then steps that go on as usual: their gradients are reduced as in one process."""
    p = st.placement("cpu", [0, 1])
    reference = _mlp()
    model = copy.deepcopy(reference).to_global(p, broadcast, bucket_mb=bucket_mb)
    ref_opt = OPTIMIZERS["sgd"](reference.parameters(), True)
    optimizer = OPTIMIZERS["sgd"](model.parameters(), True)
    to_input = lambda t: t.to_global(p, (broadcast,)).to_global(sbp=(split(0),))  # noqa: E731

    def raising(grad):
        raise RuntimeError("a hook failed")

    x, y = _batches(1)[0]
    hidden = model[1](model[0](to_input(x)))
    hidden.register_hook(raising)
    loss = nn.functional.mse_loss(model[2](hidden), to_input(y))
    with pytest.raises(RuntimeError, match="a hook failed"):
        loss.backward()
    optimizer.zero_grad()
    want = _train(reference, _batches(), ref_opt)
    got = _train(model, _batches(), optimizer, to_input)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(b.full_tensor(), a.detach(), rtol=1e-5, atol=1e-6)
    return True


@pytest.mark.parametrize("bucket_mb", [25.0, 1e-9])
def test_a_backward_that_raised_leaves_later_steps_reduced(bucket_mb):
    """With one bucket the failed backward leaves it pending; with tiny buckets it leaves all-reduces in flight."""
    assert run_on_world(2, _backward_that_raises, bucket_mb) == [True, True]


def _tied_and_errors():
    p = st.placement("cpu", [0, 1])
    emb = nn.Embedding(5, 4)
    head = nn.Linear(4, 5, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head}).to_global(p, {"*.weight": split(1)})
    assert model["emb"].weight is model["head"].weight
    with pytest.raises(ValueError, match="'0.bias'.*split dim 1"):
        nn.Sequential(nn.Linear(2, 2)).to_global(p, split(1))
    return True


def test_tied_parameters_stay_tied_and_bad_plans_name_the_tensor():
    assert all(run_on_world(2, _tied_and_errors))


def _attention_products():
    """q @ k^T and att @ v with heads split stay split (no gather), forward and backward."""
    from op_check import check_op

    torch.manual_seed(3)
    q, k = torch.randn(2, 5, 7, 4), torch.randn(2, 5, 7, 4)
    out = []
    for ranks, sbp in [([0, 1, 2], split(1)), ([0, 1, 2], split(0)), ([[0, 1], [2, 3]], (split(0), split(1)))]:
        p = st.placement("cpu", ranks)
        st.set_strict(True)
        try:
            out.append(check_op(lambda a, b: a @ b.transpose(-1, -2), [q, k], p, [sbp, sbp]))
        finally:
            st.set_strict(False)
    return out


def test_batched_matmul_keeps_head_split():
    for got in run_on_world(4, _attention_products):  # rank 3 is outside the 1-D placements
        assert got == [[(split(1),)], [(split(0),)], [(split(0), split(1))]]


def _foreach_runs_as_one_call():
    from sbp_torch._dispatch import CALLS
    from sbp_torch._dispatch._foreach import ForeachPlan

    p = st.placement("cpu", [0, 1])
    model = _mlp().to_global(p, {"0.weight": split(0), "*": broadcast})
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    for x, y in _batches(n=2):
        loss = nn.functional.mse_loss(model(x.to_global(p, broadcast)), y.to_global(p, broadcast))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return sorted({str(entry.func) for entry in CALLS.entries() if isinstance(entry, ForeachPlan)})


def test_foreach_ops_whose_indices_run_locally_become_one_local_call():
    """After the first step, AdamW's foreach ops (parameters split and broadcast alike: none needs boxing)
    run as one local foreach call each, as torch's optimizer expects; the values are checked by the
    training tests above."""
    ops = run_on_world(2, _foreach_runs_as_one_call)[0]
    assert "aten._foreach_lerp_.Scalar" in ops and "aten._foreach_addcdiv_.ScalarList" in ops, ops


def _gradient_layouts() -> list:
    """(name, the plain gradient's strides, the global gradient part's, the largest difference of their values) of
    a tiny transformers GPT-2, whose output layer is its embedding's weight, tied through ``t()``, after two steps
    with gradients set to None between them."""
    from zoo import gpt as gpt_models

    c = gpt_models.config(cuda=False, quick=True)
    ids = torch.randint(0, c["vocab"], (c["batch"], c["seq"]), generator=torch.Generator().manual_seed(0))
    grads = []
    for library in ("plain", "sbp_torch"):
        model, loss_of = gpt_models.make_model("transformers GPT-2", c, "cpu")
        model, lay_out, _ = gpt_models.laid_out(library, model, "cpu")
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            loss_of(model, lay_out(ids)).backward()
        grads.append({n: p.grad.to_local() if library == "sbp_torch" else p.grad for n, p in model.named_parameters()})
    plain, laid_out = grads
    return [(n, plain[n].stride(), laid_out[n].stride(), float((plain[n] - laid_out[n]).abs().max())) for n in plain]


def test_gradients_take_their_parameters_layout():
    """As torch's AccumulateGrad gives a plain gradient its parameter's strides, so the parts of global gradients
    (a transposed part would send every foreach op of the optimizer down its per-tensor path on CUDA)."""
    pytest.importorskip("transformers")
    (layouts,) = run_on_world(1, _gradient_layouts, _timeout=300)
    assert any(name == "transformer.wte.weight" for name, *_ in layouts)
    for name, plain, laid_out, difference in layouts:
        assert laid_out == plain, f"{name}: the gradient's part has strides {laid_out}, the plain gradient {plain}"
        assert difference < 1e-5, name
