"""DTensor interop (``to_dtensor``, ``from_dtensor``, ``module_to_dtensor``, ``module_from_dtensor``) against one
process.

Values are whole numbers (in floating dtypes too), so a partial sum is exact in any order and both libraries'
reductions give the same bits. The driver rebuilds each logical tensor from the parts with ``reference.assemble``
(a concatenation, so it fits DTensor's parts too) and checks each library's parts against the box that library
documents: sbp_torch's balanced parts, DTensor's ``torch.chunk`` parts (written out here, not taken from torch).
The plan tests need no process group.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st_
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import sbp_torch as st
from sbp_torch import _comm as comm
from sbp_torch._api._dtensor import device_mesh, relayout
from sbp_torch._comm._collectives import POINT_TO_POINT
from sbp_torch._layout import Broadcast, GlobalMeta, Split, normalize_sbp
from sbp_torch.sbp import broadcast, partial, partial_max, partial_min, partial_sum, split

from reference import assemble, coords, partial_free, random_parts
from world import run_on_world


def _meta(ranks, shape, sbp, dtype=torch.float64) -> GlobalMeta:
    p = st.placement("cpu", ranks)
    return GlobalMeta(tuple(shape), dtype, p, normalize_sbp(sbp, p, len(shape), dtype))


def chunk_box(meta: GlobalMeta, coord) -> tuple[list[int], list[int]]:
    """DTensor's box at ``coord``: per mesh dim, in order, ``Shard(d)`` keeps chunk ``coord`` of ``ceil(n / p)``
    rows of the current extent (the last chunks shorter or empty), as ``torch.chunk``."""
    starts, lengths = [0] * len(meta.shape), list(meta.shape)
    for axis, sbp in enumerate(meta.sbp):
        if isinstance(sbp, Split):
            n, size = lengths[sbp.dim], math.ceil(lengths[sbp.dim] / meta.placement.shape[axis])
            first = min(coord[axis] * size, n)
            starts[sbp.dim] += first
            lengths[sbp.dim] = min(size, n - first)
    return starts, lengths


def _box(x: torch.Tensor, box) -> torch.Tensor:
    return x[tuple(slice(s, s + n) for s, n in zip(*box))]


def sbp_parts(meta: GlobalMeta, seed: int) -> dict:
    """Random whole-number parts in sbp_torch's layout (broadcast axes hold copies)."""
    as_int = GlobalMeta(meta.shape, torch.int64, meta.placement, meta.sbp)
    parts = random_parts(as_int, torch.Generator().manual_seed(seed))
    return {c: t.to(meta.dtype) for c, t in parts.items()}


def dtensor_parts(meta: GlobalMeta, seed: int) -> dict:
    """Random whole-number parts in DTensor's layout (broadcast axes hold copies)."""
    g = torch.Generator().manual_seed(seed)
    parts = {}
    for c in coords(meta.placement.shape):
        source = tuple(0 if isinstance(s, Broadcast) else i for s, i in zip(meta.sbp, c))
        if source != c:
            parts[c] = parts[source].clone()
        else:
            parts[c] = torch.randint(-5, 6, chunk_box(meta, c)[1], generator=g).to(meta.dtype)
    return parts


def _local(parts: dict, meta: GlobalMeta) -> torch.Tensor:
    coord = meta.placement.local_coord()
    return parts[coord].clone() if coord is not None else torch.empty(0, dtype=meta.dtype)


def _dtensor_placements(sbp) -> list:
    out = []
    for s in sbp:
        if isinstance(s, Split):
            out.append(Shard(s.dim))
        elif isinstance(s, Broadcast):
            out.append(Replicate())
        else:
            out.append(Partial(s.op))
    return out


def _dtensor_from_parts(parts: dict, meta: GlobalMeta, requires_grad=False, grad_sbp=None) -> tuple:
    local = _local(parts, meta).requires_grad_(requires_grad)
    grad_placements = None if grad_sbp is None else _dtensor_placements(grad_sbp)
    d = DTensor.from_local(
        local,
        device_mesh(meta.placement),
        _dtensor_placements(meta.sbp),
        shape=torch.Size(meta.shape),
        stride=meta.strides,
        grad_placements=grad_placements,
    )
    return local, d


# ---------------------------------------------------------------------------------------------------------
# Plans (no process group)


@pytest.mark.parametrize(
    "ranks, shape, sbp, shared, elements_moved",
    [
        ([0, 1, 2, 3], (8, 3), split(0), True, 0),  # even
        ([0, 1], (7, 3), split(0), True, 0),  # on two ranks balanced parts are torch.chunk's
        ([0, 1, 2], (5,), split(0), True, 0),  # 2, 2, 1 in both
        ([0, 1, 2], (7, 3), broadcast, True, 0),
        ([0, 1, 2], (7, 3), partial_max, True, 0),
        ([[0, 1], [2, 3]], (7, 5), (split(0), split(1)), True, 0),
        ([0, 1, 2], (7, 3), split(0), False, 3),  # 3, 2, 2 against 3, 3, 1: row 5 moves from rank 2 to 1
        ([0, 1, 2, 3], (6,), split(0), False, 1),  # 2, 2, 1, 1 against 2, 2, 2, 0
        ([0, 1, 2], (3, 7), split(1), False, 3),  # the same in columns: one column of 3 rows
        ([[0, 1, 2], [3, 4, 5]], (7, 2), (partial_sum, split(0)), False, 4),  # one row per partial term
    ],
)
def test_plan(ranks, shape, sbp, shared, elements_moved):
    meta = _meta(ranks, shape, sbp)
    plan = relayout(meta)
    assert plan.shared == shared
    assert plan.bytes_moved(to_dtensor=True) == plan.bytes_moved(to_dtensor=False) == elements_moved * 8
    for c in coords(meta.placement.shape):
        starts, lengths = chunk_box(meta, c)
        assert plan.dtensor_boxes[c][1] == tuple(lengths)
        assert 0 in lengths or plan.dtensor_boxes[c][0] == tuple(starts)


def test_partial_terms_come_from_their_own_holders():
    """A rank's summand comes from a rank with the same coordinate on the partial axis."""
    meta = _meta([[0, 1, 2], [3, 4, 5]], (7, 2), (partial_sum, split(0)))
    sent = [p for p in relayout(meta).to_dtensor if not p.is_local]
    assert {(p.src, p.dst) for p in sent} == {(2, 1), (5, 4)}


def test_wrong_types():
    with pytest.raises(TypeError, match="global tensor"):
        st.GlobalTensor.to_dtensor(torch.zeros(2))
    with pytest.raises(TypeError, match="takes a DTensor"):
        st.from_dtensor(torch.zeros(2))


# ---------------------------------------------------------------------------------------------------------
# Round trips: random shapes and layouts, both directions


def roundtrip_on_ranks(ranks, cases):
    """Per case: a global tensor from whole-number parts to DTensor and back, and a DTensor from parts to a
    global tensor and back. Returns what the driver compares, per case."""
    out = []
    for shape, sbp, dtype, seed in cases:
        meta = _meta(ranks, shape, sbp, dtype)
        g = _local(sbp_parts(meta, seed), meta).to_global(meta.placement, sbp)
        d = g.to_dtensor()
        back = st.from_dtensor(d)
        assert isinstance(d, DTensor) and d.placements == tuple(_dtensor_placements(meta.sbp))
        assert back.sbp == g.sbp and back.placement == g.placement and back.shape == g.shape
        assert torch.equal(back.to_local(), g.to_local()), "from_dtensor(to_dtensor(g)) changed a part"
        _, e = _dtensor_from_parts(dtensor_parts(meta, seed), meta)
        h = st.from_dtensor(e)
        again = h.to_dtensor()
        assert torch.equal(again.to_local(), e.to_local()), "to_dtensor(from_dtensor(d)) changed a part"
        out.append((d.to_local(), d.full_tensor(), g.full_tensor(), h.to_local(), h.full_tensor(), e.full_tensor()))
    return out


def check_roundtrips(world, ranks, cases):
    results = run_on_world(world, roundtrip_on_ranks, ranks, cases)
    for i, (shape, sbp, dtype, seed) in enumerate(cases):
        meta = _meta(ranks, shape, sbp, dtype)
        p, what = meta.placement, f"{ranks} {sbp} {shape} {dtype}"
        logical = assemble(sbp_parts(meta, seed), p.shape, meta.sbp)
        native = assemble(dtensor_parts(meta, seed), p.shape, meta.sbp)
        for rank in range(world):
            d_local, d_full, g_full, h_local, h_full, e_full = results[rank][i]
            coord = p.coord_of(rank)
            if coord is None:
                assert d_local.numel() == h_local.numel() == 0, f"{what}: rank {rank} is outside"
                continue
            assert torch.equal(d_full, logical) and torch.equal(g_full, logical), f"{what}: full tensor"
            assert torch.equal(h_full, native) and torch.equal(e_full, native), f"{what}: full tensor of a DTensor"
            if partial_free(meta):
                assert torch.equal(d_local, _box(logical, chunk_box(meta, coord))), f"{what}: DTensor part"
                assert torch.equal(h_local, _box(native, meta.region(coord))), f"{what}: global part"


# 1-D on 3 ranks and on 2 of them (rank 1 outside), 2-D arrays of 3 ranks; 2x2 meshes in both rank orders
_PLACEMENTS = {3: [[0, 1, 2], [0, 2], [[0, 1, 2]], [[0], [1], [2]]], 4: [[[0, 1], [2, 3]], [[0, 2], [1, 3]]]}


@st_.composite
def roundtrip_cases(draw, ndim_placement: int):
    """Mostly uneven shapes (sizes that 2 and 3 ranks cut differently come first), splits twice as likely as
    broadcast or partial."""
    ndim = draw(st_.sampled_from([1, 2, 3, 0]))
    shape = tuple(draw(st_.lists(st_.sampled_from([7, 4, 5, 6, 1, 3, 0, 2]), min_size=ndim, max_size=ndim)))
    op = draw(st_.sampled_from(["sum", "max", "min"]))  # a DTensor holds one reduction
    choices = [split(d) for d in range(ndim)] * 2 + [broadcast, partial(op)]
    sbp = tuple(draw(st_.sampled_from(choices)) for _ in range(ndim_placement))
    return shape, sbp, draw(st_.sampled_from([torch.float64, torch.float32, torch.int64])), draw(st_.integers(0, 99))


@pytest.mark.gloo
@pytest.mark.parametrize("world", [3, 4])
def test_roundtrips_are_exact(world):
    # no shrinking: each failing example kills a world, and the whole list is printed
    @settings(max_examples=6, deadline=None, phases=(Phase.explicit, Phase.generate))
    @given(st_.data())
    def check(data):
        ranks = data.draw(st_.sampled_from(_PLACEMENTS[world]))
        ndim = 2 if isinstance(ranks[0], list) else 1
        check_roundtrips(world, ranks, data.draw(st_.lists(roundtrip_cases(ndim), min_size=4, max_size=6)))

    check()


@pytest.mark.gloo
def test_partial_terms_with_uneven_splits_on_a_2x3_mesh():
    ranks = [[0, 1, 2], [3, 4, 5]]
    cases = [
        ((7, 2), (partial_sum, split(0)), torch.float64, 1),
        ((2, 7), (split(0), split(1)), torch.float32, 2),
        ((7, 4), (split(0), split(0)), torch.int64, 3),
        ((4, 7), (partial_max, split(1)), torch.float64, 4),
        ((7,), (broadcast, split(0)), torch.float64, 5),
    ]
    check_roundtrips(6, ranks, cases)


# ---------------------------------------------------------------------------------------------------------
# Shared storage where the layouts agree; only the missing rows move where they differ


def storage_on_ranks(ranks, shape, sbp):
    """(to_dtensor shares, from_dtensor shares, bytes sent in to_dtensor, in from_dtensor, collectives seen)."""
    meta = _meta(ranks, shape, sbp)
    g = _local(sbp_parts(meta, 0), meta).to_global(meta.placement, sbp)
    g.to_dtensor()  # the mesh exists before bytes are counted
    seen = []
    with comm.observing(lambda kind, group, nbytes: seen.append((kind, nbytes))):
        d = g.to_dtensor()
        sent_to = sum(n for _, n in seen)
        back = st.from_dtensor(d)
    sent_from = sum(n for _, n in seen) - sent_to
    shares = d._local_tensor.data_ptr() == g._local.data_ptr()
    shares_back = back._local.data_ptr() == d._local_tensor.data_ptr()
    return shares and g._local.numel() > 0, shares_back and g._local.numel() > 0, sent_to, sent_from, seen


def missing_bytes(meta: GlobalMeta, held, needed) -> int:
    """Bytes every rank needs and does not hold, from the two libraries' documented boxes."""
    total = 0
    for c in coords(meta.placement.shape):
        (hs, hn), (ns, nn_) = held(meta, c), needed(meta, c)
        common = math.prod(max(0, min(a + m, b + n) - max(a, b)) for a, m, b, n in zip(hs, hn, ns, nn_))
        total += (math.prod(nn_) - common) * meta.dtype.itemsize
    return total


@pytest.mark.gloo
@pytest.mark.parametrize(
    "world, ranks, shape, sbp, shared_on",
    [
        (4, [[0, 1], [2, 3]], (4, 6), (split(0), split(1)), {0, 1, 2, 3}),  # even: every rank shares
        (4, [[0, 1], [2, 3]], (7, 5), (split(1), partial_sum), {0, 1, 2, 3}),  # two parts per axis: the same
        (3, [0, 1, 2], (7, 3), split(0), {0}),  # 3, 2, 2 against 3, 3, 1: rank 0 keeps its part
        (4, [0, 1, 2, 3], (6, 2), split(0), {0, 1}),  # 2, 2, 1, 1 against 2, 2, 2, 0
        (3, [0, 1, 2], (2, 7), split(1), {0}),
    ],
)
def test_storage_is_shared_and_only_missing_bytes_move(world, ranks, shape, sbp, shared_on):
    meta = _meta(ranks, shape, sbp)
    results = run_on_world(world, storage_on_ranks, ranks, shape, sbp)
    assert {r for r in range(world) if results[r][0]} == shared_on
    assert {r for r in range(world) if results[r][1]} == shared_on
    assert {kind for r in range(world) for kind, _ in results[r][4]} <= {POINT_TO_POINT}
    assert sum(r[2] for r in results) == missing_bytes(meta, GlobalMeta.region, chunk_box)
    assert sum(r[3] for r in results) == missing_bytes(meta, chunk_box, GlobalMeta.region)


# ---------------------------------------------------------------------------------------------------------
# Gradients through both directions, against one process


def gradients_on_ranks(ranks, shape, sbp, seed):
    """Gradients of sum(full_tensor * W) with respect to this rank's part, through to_dtensor (the full tensor
    taken by DTensor) and through from_dtensor (the full tensor taken by sbp_torch)."""
    meta = _meta(ranks, shape, sbp)
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    inside = meta.placement.local_coord() is not None
    x = _local(sbp_parts(meta, seed), meta).requires_grad_()
    d = x.to_global(meta.placement, sbp).to_dtensor()
    if inside:  # DTensor's full_tensor has no backward on a rank outside its mesh
        (d.full_tensor() * weight).sum().backward()
    y, e = _dtensor_from_parts(dtensor_parts(meta, seed), meta, requires_grad=True, grad_sbp=st.gradient_sbp(meta.sbp))
    (st.from_dtensor(e).full_tensor() * (weight if inside else 1.0)).sum().backward()
    return x.grad, y.grad


@pytest.mark.gloo
@pytest.mark.parametrize(
    "world, ranks, shape, sbp",
    [
        (3, [0, 1, 2], (7, 3), split(0)),
        (3, [0, 2], (5, 3), partial_sum),
        (3, [0, 1, 2], (4, 3), partial_max),
        (4, [[0, 1], [2, 3]], (3, 5), (partial_min, split(1))),
        (4, [[0, 1], [2, 3]], (7, 3), (split(0), broadcast)),
    ],
)
def test_gradients_against_one_process(world, ranks, shape, sbp):
    meta = _meta(ranks, shape, sbp)
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    results = run_on_world(world, gradients_on_ranks, ranks, shape, sbp, 5)
    for parts, got in ((sbp_parts(meta, 5), 0), (dtensor_parts(meta, 5), 1)):
        leaves = {c: t.clone().requires_grad_() for c, t in parts.items()}
        (assemble(leaves, meta.placement.shape, meta.sbp) * weight).sum().backward()
        for rank in range(world):
            coord = meta.placement.coord_of(rank)
            grad = results[rank][got]
            if coord is None:
                assert grad is None or grad.numel() == 0
            else:
                torch.testing.assert_close(grad, leaves[coord].grad, msg=f"{sbp} direction {got}: rank {rank}")


# ---------------------------------------------------------------------------------------------------------
# Modules: a global model handed to DTensor code and taken back


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(5, 7)
        self.down = nn.Linear(7, 3)
        self.register_buffer("scale", torch.arange(1.0, 4.0))

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) * self.scale


_PLAN = {"up.weight": split(0), "up.bias": split(0), "down.weight": split(1), "scale": split(0)}


def _tiny() -> Tiny:
    torch.manual_seed(0)
    return Tiny().double()


def _batch():
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def module_on_ranks():
    """A Megatron-style model over 3 ranks (uneven: 7 rows), one step of DTensor forward/backward, then back."""
    p = st.placement.all("cpu")
    model = _tiny().to_global(p, _PLAN)
    st.module_to_dtensor(model)
    assert all(isinstance(t, DTensor) for t in [*model.parameters(), *model.buffers()])
    assert isinstance(model.up.weight, nn.Parameter) and model.up.weight.placements == (Shard(0),)
    x = distribute_tensor(_batch(), model.up.weight.device_mesh, [Replicate()])
    loss = model(x).pow(2).sum()
    loss.backward()
    st.module_from_dtensor(model)
    assert isinstance(model.up.weight, nn.Parameter) and model.up.weight.sbp == (split(0),)
    assert model.scale.sbp == (split(0),) and not isinstance(model.scale, nn.Parameter)
    grads = {n: t.grad.full_tensor() for n, t in model.named_parameters()}
    again = model(_batch().to_global(p, broadcast)).full_tensor()  # back in sbp_torch: runs in global mode
    return loss.detach().full_tensor(), grads, again.detach()


@pytest.mark.gloo
def test_module_round_trip_against_one_process():
    model = _tiny()
    loss = model(_batch()).pow(2).sum()
    loss.backward()
    for got_loss, grads, again in run_on_world(3, module_on_ranks):
        torch.testing.assert_close(got_loss, loss.detach())
        for name, param in model.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, msg=name)
        torch.testing.assert_close(again, model(_batch()).detach())


# ---------------------------------------------------------------------------------------------------------
# Errors, alike on every rank


def errors_on_ranks():
    mesh = device_mesh(st.placement.all("cpu"))
    messages = []
    for placements in ([_StridedShard(0, split_factor=2)], [Partial("avg")]):
        d = DTensor.from_local(torch.zeros(2, 3), mesh, placements, shape=torch.Size((4, 3)), stride=(3, 1))
        try:
            st.from_dtensor(d)
        except ValueError as err:
            messages.append(str(err))
    torch.manual_seed(0)
    g = st.randn(4, 3, placement=st.placement("cpu", [[0], [1]]), sbp=(partial_max, partial_sum))
    try:
        g.to_dtensor()
    except ValueError as err:
        messages.append(str(err))
    unordered = st.placement("cpu", [2, 0, 1])  # (DTensor's gathers and cuts disagree on such a mesh)
    for convert in (
        lambda: st.arange(6, placement=unordered, sbp=split(0)).to_dtensor(),
        lambda: st.from_dtensor(DTensor.from_local(torch.zeros(2), DeviceMesh("cpu", [2, 0, 1]), [Shard(0)])),
    ):
        try:
            convert()
        except ValueError as err:
            messages.append(str(err))
    return messages


@pytest.mark.gloo
def test_unsupported_layouts_raise_naming_them():
    results = run_on_world(3, errors_on_ranks)
    assert results[0] == results[1] == results[2] and len(results[0]) == 5
    strided, avg, mixed, unordered_to, unordered_from = results[0]
    assert unordered_to.startswith("to_dtensor: placement(type='cpu', ranks=[2, 0, 1]) lists ranks out of")
    assert unordered_from.startswith("from_dtensor: placement(type='cpu', ranks=[2, 0, 1]) lists ranks out of")
    assert "_StridedShard(dim=0, sf=2)" in strided and "from_dtensor" in strided
    assert "Partial(avg)" in avg
    assert "(P(max), P)" in mixed and "max and sum" in mixed


def slice_on_ranks():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    d = DTensor.from_local(torch.zeros(2), mesh["tp"], [Shard(0)], shape=torch.Size((4,)), stride=(1,))
    try:
        st.from_dtensor(d)
    except ValueError as err:
        return str(err)


@pytest.mark.gloo
def test_a_slice_of_a_mesh_is_refused():
    """Each rank sees another slice of the mesh: there is no one placement to map it to."""
    for message in run_on_world(4, slice_on_ranks):
        assert message is not None and "slice of a larger DeviceMesh" in message
