"""Local <-> global conversions on real gloo worlds, against single-process references.

Covers ``to_local``, ``full_tensor``, ``is_global``, the ``placement``/``sbp`` properties and ``repr``; what the
logical tensor is when it is made from local parts (split: concatenation, even when the parts are unbalanced;
broadcast: the first rank's part; partial: the reduction of all parts); gradients through ``to_local``; ranks
outside the placement; and bad input, which must raise the same clear error on every rank instead of hanging.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import sbp_torch as st
from sbp_torch._layout import GlobalMeta, normalize_sbp
from sbp_torch.sbp import broadcast, partial_max, partial_min, partial_sum, split

from reference import assemble, coords, expected_region, partial_free
from world import run_on_world

pytestmark = pytest.mark.gloo

ERROR_TIMEOUT = 30.0  # a body that hangs in a collective fails the test after this many seconds


def _parts(ranks, shapes: dict, dtype=torch.float64, seed=0) -> dict:
    """Random local parts by placement coordinate, of the given (possibly unbalanced) shapes."""
    gen = torch.Generator().manual_seed(seed)
    return {c: torch.randn(shapes[c], generator=gen, dtype=torch.float64).to(dtype) for c in sorted(shapes)}


def _my_part(p, parts, dtype=torch.float64) -> torch.Tensor:
    coord = p.coord_of(dist.get_rank())
    return parts[coord].clone() if coord is not None else torch.empty(0, dtype=dtype)


# ---------------------------------------------------------------------------------------------------------
# Properties, to_local, full_tensor, repr


def properties_body(ranks, shape, sbp):
    """Every rank: make a global tensor from balanced parts and report what it sees."""
    p = st.placement("cpu", ranks)
    meta = GlobalMeta(tuple(shape), torch.float64, p, normalize_sbp(sbp, p, len(shape), torch.float64))
    parts = _parts(ranks, {c: meta.local_shape(c) for c in coords(p.shape)})
    plain = _my_part(p, parts)
    g = plain.to_global(p, sbp)
    return {
        "plain_is_global": plain.is_global,
        "is_global": g.is_global,
        "isinstance": isinstance(g, st.GlobalTensor),
        "placement": g.placement,
        "sbp": g.sbp,
        "shape": tuple(g.shape),
        "dtype": g.dtype,
        "local": g.to_local().detach(),
        "local_fn": st.to_local(g).detach(),
        "full": g.full_tensor().detach(),
        "full_fn": st.full_tensor(g).detach(),
    }


@pytest.mark.parametrize(
    "ranks,shape,sbp",
    [
        ([0, 1], (5, 3), split(0)),
        ([0, 1, 2], (4, 7), split(1)),
        ([1, 0], (2, 3), broadcast),
        ([[0, 1], [2, 3]], (5, 3), (split(0), split(1))),
        ([[0, 1], [2, 3]], (3, 5), (broadcast, split(1))),
    ],
    ids=str,
)
def test_properties_to_local_and_full_tensor(ranks, shape, sbp):
    """``is_global`` is False on plain tensors and True on global ones; ``placement``/``sbp``/shape/dtype are
    reported; ``to_local`` (method and function) is this rank's balanced part and ``full_tensor`` the logical
    tensor on every rank."""
    p = st.placement("cpu", ranks)
    results = run_on_world(max(p.flat_ranks) + 1, properties_body, ranks, shape, sbp)
    norm = normalize_sbp(sbp, p, len(shape), torch.float64)
    meta = GlobalMeta(tuple(shape), torch.float64, p, norm)
    parts = _parts(ranks, {c: meta.local_shape(c) for c in coords(p.shape)})
    logical = assemble(parts, p.shape, norm)
    for rank, got in enumerate(results):
        coord = p.coord_of(rank)
        assert got["plain_is_global"] is False
        assert got["is_global"] is True and got["isinstance"] is True
        assert got["placement"] == p and got["sbp"] == norm
        assert got["shape"] == tuple(shape) and got["dtype"] == torch.float64
        torch.testing.assert_close(got["local"], expected_region(logical, meta, coord))
        torch.testing.assert_close(got["local_fn"], got["local"])
        torch.testing.assert_close(got["full"], logical)
        torch.testing.assert_close(got["full_fn"], logical)


def repr_body():
    """Only rank 0 prints the tensor; then every rank boxes it. A collective inside repr would hang here."""
    p = st.placement("cpu", [0, 1])
    g = torch.arange(6.0).reshape(3, 2).to_global(p, split(0), check_meta=False)  # rank i holds rows 3i..3i+2
    text = None
    if dist.get_rank() == 0:
        text = (repr(g), str(g), repr(g.detach().requires_grad_()))
    full = g.to_global(sbp=broadcast).full_tensor()
    return text, full


def test_repr_runs_no_collective():
    """``repr``/``str`` of a global tensor on one rank only do not block; the ranks stay in step afterwards,
    and the text names the layout."""
    results = run_on_world(2, repr_body, _timeout=ERROR_TIMEOUT)
    text, grad_text = results[0][0][0], results[0][0][2]
    assert results[1][0] is None
    assert text.startswith("GlobalTensor(") and "S(0)" in text and "shape=(6, 2)" in text
    assert "ranks=[0, 1]" in text and "local=" in text and results[0][0][1] == text
    assert "requires_grad=True" in grad_text
    for _, full in results:
        torch.testing.assert_close(full, torch.cat([torch.arange(6.0).reshape(3, 2)] * 2))


def sync_data_body():
    """``sync_data=False``: a broadcast (or broadcast-then-split) tensor from each rank's own part, nothing sent,
    eagerly and compiled; the gradient against one process; a global input refused."""
    from strict_check import recording_collectives

    rank, p = dist.get_rank(), st.placement("cpu", [0, 1])
    x = torch.arange(6.0).reshape(3, 2).requires_grad_()
    weight = torch.tensor([[1.0, -2.0]] * 3)
    with recording_collectives("broadcast", "all_gather", "all_reduce") as sent:
        g = x.to_global(p, broadcast, check_meta=False, sync_data=False)
        rows = g.to_global(sbp=split(0))
    unsynced = torch.full((2,), float(rank)).to_global(p, broadcast, check_meta=False, sync_data=False)
    twice = torch.compile(
        lambda t: t.to_global(p, broadcast, check_meta=False, sync_data=False) * 2, backend="aot_eager"
    )
    # the traced program, then the same program on new values
    compiled = [twice(t).full_tensor() for t in (x.detach(), -x.detach())]
    (g * weight.to_global(p, broadcast, check_meta=False, sync_data=False)).sum().backward()
    try:
        g.detach().to_global(sbp=split(0), sync_data=False)
        refused = None
    except ValueError as err:
        refused = str(err)
    return sent, rows.to_local().detach(), unsynced.to_local(), compiled, x.grad, refused


def broadcast_max_body():
    """``(broadcast, partial_max)`` from parts that differ down the broadcast axis: the first row's values are the
    tensor's, and its gradient's tie shares come from them on every row."""
    p = st.placement("cpu", [[0, 1], [2, 3]])
    values = {0: [1.0, 5.0], 1: [3.0, 2.0], 2: [9.0, 0.0], 3: [0.0, 9.0]}  # (the second row's: ignored)
    x = torch.tensor(values[dist.get_rank()], requires_grad=True)
    full = x.to_global(p, (broadcast, partial_max)).full_tensor()
    full.sum().backward()
    return full.detach(), x.grad


def test_a_max_laid_out_with_a_broadcast_axis_shares_its_gradient_by_the_first_row():
    first_row = [torch.tensor([1.0, 5.0], requires_grad=True), torch.tensor([3.0, 2.0], requires_grad=True)]
    torch.maximum(*first_row).sum().backward()
    for rank, (full, grad) in enumerate(run_on_world(4, broadcast_max_body)):
        torch.testing.assert_close(full, torch.tensor([3.0, 5.0]))
        torch.testing.assert_close(grad, first_row[rank % 2].grad, msg=f"rank {rank}")


def test_sync_data_false_takes_each_rank_s_own_part():
    for rank, (sent, rows, unsynced, compiled, grad, refused) in enumerate(run_on_world(2, sync_data_body)):
        assert sent == [], sent
        full = torch.arange(6.0).reshape(3, 2)
        torch.testing.assert_close(rows, full[:2] if rank == 0 else full[2:])
        torch.testing.assert_close(unsynced, torch.full((2,), float(rank)))  # the promise broken: not repaired
        torch.testing.assert_close(compiled, [full * 2, full * -2])
        torch.testing.assert_close(grad, torch.tensor([[1.0, -2.0]] * 3))  # one process's gradient
        assert "sync_data=False applies to a local tensor" in refused


# ---------------------------------------------------------------------------------------------------------
# local -> global semantics (uneven and unbalanced parts, nested splits, broadcast, partial), with gradients


def from_local_body(ranks, shapes, sbp, dtype, seed):
    """Every rank: its part of ``shapes`` -> to_global; returns (local, full, d sum(full*W)/d part)."""
    p = st.placement("cpu", ranks)
    parts = _parts(ranks, shapes, dtype, seed)
    x = _my_part(p, parts, dtype).requires_grad_(dtype.is_floating_point)
    g = x.to_global(p, sbp)
    full = g.full_tensor()
    if dtype.is_floating_point and p.coord_of(dist.get_rank()) is not None:
        weight = torch.randn(full.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)
        (full * weight).sum().backward()
    return tuple(g.shape), g.sbp, g.to_local().detach(), full.detach(), x.grad


def check_from_local(ranks, shapes, sbp, dtype=torch.float64, seed=0):
    """Run ``from_local_body`` and compare with the reference: ``full_tensor`` is ``assemble`` of the parts on
    every rank, the new local parts are the balanced split of it (partial parts are kept as they are), and the
    gradient of each part is what autograd gives through ``assemble``."""
    p = st.placement("cpu", ranks)
    results = run_on_world(max(p.flat_ranks) + 1, from_local_body, ranks, shapes, sbp, dtype, seed)
    norm = normalize_sbp(sbp, p, len(shapes[(0,) * p.ndim]), dtype)
    floating = dtype.is_floating_point
    leaves = {c: t.requires_grad_(floating) for c, t in _parts(ranks, shapes, dtype, seed).items()}
    logical = assemble(leaves, p.shape, norm)
    meta = GlobalMeta(tuple(logical.shape), dtype, p, norm)
    if floating:
        weight = torch.randn(logical.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)
        (logical * weight).sum().backward()
    for rank, (shape, got_sbp, local, full, grad) in enumerate(results):
        coord = p.coord_of(rank)
        assert shape == tuple(logical.shape) and got_sbp == norm
        if coord is None:  # outside the placement
            assert local.numel() == 0 and full.numel() == 0
            continue
        torch.testing.assert_close(full, logical.detach(), msg=f"full_tensor on rank {rank}")
        if partial_free(meta):
            torch.testing.assert_close(local, expected_region(logical.detach(), meta, coord), msg=f"rank {rank}")
        if floating:
            torch.testing.assert_close(grad, leaves[coord].grad, msg=f"gradient of the part of rank {rank}")
    locals_ = {p.coord_of(r): results[r][2] for r in p.flat_ranks}
    torch.testing.assert_close(assemble(locals_, p.shape, norm), logical.detach())


FROM_LOCAL_CASES = {
    # split with unbalanced parts: rank 0 has 3 rows, rank 1 has 1 -> logical is their concatenation (4 rows)
    "S0 3+1 rows": ([0, 1], {(0,): (3, 2), (1,): (1, 2)}, split(0)),
    "S1 0+4+1 cols": ([0, 1, 2], {(0,): (2, 0), (1,): (2, 4), (2,): (2, 1)}, split(1)),
    "S0 unsorted placement": ([2, 0, 1], {(0,): (1, 3), (1,): (0, 3), (2,): (5, 3)}, split(-2)),
    "S0 even but not balanced": ([0, 1, 2], {(0,): (1,), (1,): (3,), (2,): (2,)}, split(0)),
    "S0 balanced": ([0, 1, 2], {(0,): (3, 2), (1,): (2, 2), (2,): (2, 2)}, split(0)),
    # nested split of one dim on a 2x2 mesh: row blocks in order (0,0), (0,1), (1,0), (1,1)
    "S0,S0 nested": (
        [[0, 1], [2, 3]],
        {(0, 0): (2, 2), (0, 1): (1, 2), (1, 0): (0, 2), (1, 1): (3, 2)},
        (split(0), split(0)),
    ),
    # 2-D blocks: rows by mesh row (3, 1), columns by mesh column (1, 2)
    "S0,S1 blocks": (
        [[0, 1], [2, 3]],
        {(0, 0): (3, 1), (0, 1): (3, 2), (1, 0): (1, 1), (1, 1): (1, 2)},
        (split(0), split(1)),
    ),
    "S1,S0 blocks": (
        [[3, 1], [0, 2]],
        {(0, 0): (2, 1), (0, 1): (0, 1), (1, 0): (2, 3), (1, 1): (0, 3)},
        (split(1), split(0)),
    ),
    # broadcast takes index 0's part even though every rank passes a different value
    "B differs per rank": ([0, 1, 2], {(0,): (2, 3), (1,): (2, 3), (2,): (2, 3)}, broadcast),
    "B first rank is 1": ([1, 0], {(0,): (4,), (1,): (4,)}, broadcast),
    "S0,B differs": (
        [[0, 1], [2, 3]],
        {(0, 0): (1, 2), (0, 1): (1, 2), (1, 0): (3, 2), (1, 1): (3, 2)},
        (split(0), broadcast),
    ),
    # partial: the reduction of every rank's part
    "P sum": ([0, 1, 2], {(0,): (2, 3), (1,): (2, 3), (2,): (2, 3)}, partial_sum),
    "P max": ([0, 1, 2], {(0,): (3,), (1,): (3,), (2,): (3,)}, partial_max),
    "P min": ([2, 1], {(0,): (2, 2), (1,): (2, 2)}, partial_min),
    "P,S1 unbalanced": (
        [[0, 1], [2, 3]],
        {(0, 0): (2, 3), (0, 1): (2, 0), (1, 0): (2, 3), (1, 1): (2, 0)},
        (partial_sum, split(1)),
    ),
    "Pmax,S0 unbalanced": (
        [[0, 1], [2, 3]],
        {(0, 0): (1, 2), (0, 1): (2, 2), (1, 0): (1, 2), (1, 1): (2, 2)},
        (partial_max, split(0)),
    ),
}


@pytest.mark.parametrize("case", list(FROM_LOCAL_CASES))
def test_from_local_semantics_and_gradient(case):
    """The logical tensor made from local parts, the balanced re-cut, and the gradients of the parts."""
    check_from_local(*FROM_LOCAL_CASES[case])


@pytest.mark.parametrize("sbp", [split(0), broadcast, partial_sum, partial_max, partial_min], ids=repr)
def test_from_local_integer_parts(sbp):
    """Integer parts (no gradient) assemble like float ones, also when unbalanced."""
    rows = {split(0): [2, 0, 3]}.get(sbp, [2, 2, 2])
    check_from_local([0, 1, 2], {(i,): (n, 2) for i, n in enumerate(rows)}, sbp, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------------------
# Gradients of to_local


def to_local_grad_body(ranks, shape, sbp, grad_sbp):
    """Every rank: its part (x) -> global -> to_local(grad_sbp=...) -> loss = sum(local * w_rank)."""
    p = st.placement("cpu", ranks)
    rank = dist.get_rank()
    meta = GlobalMeta(tuple(shape), torch.float64, p, normalize_sbp(sbp, p, len(shape), torch.float64))
    x = torch.randn(meta.local_shape(p.coord_of(rank)), dtype=torch.float64, requires_grad=True)
    local = x.to_global(p, sbp).to_local(grad_sbp=grad_sbp)
    w = torch.full(local.shape, float(rank + 1), dtype=torch.float64)
    (local * w).sum().backward()
    return x.grad


@pytest.mark.parametrize(
    "ranks,sbp,grad_sbp,expected",
    [
        # default: split -> split, broadcast -> broadcast, partial_sum -> broadcast: each part gets its own w
        ([0, 1, 2], split(0), None, lambda w, ws: w),
        ([0, 1, 2], broadcast, None, lambda w, ws: w),
        ([0, 1, 2], partial_sum, None, lambda w, ws: w),
        # the same, spelled out
        ([0, 1, 2], split(0), split(0), lambda w, ws: w),
        # grad_sbp=partial_sum: the local gradients are summed into one logical gradient, which every part gets
        ([0, 1, 2], broadcast, partial_sum, lambda w, ws: sum(ws)),
        ([0, 1, 2], partial_sum, partial_sum, lambda w, ws: sum(ws)),
        # 2-D: summed along the partial axis (mesh columns) only
        ([[0, 1], [2, 3]], (split(0), broadcast), (split(0), partial_sum), lambda w, ws: None),
    ],
    ids=lambda v: repr(v) if not callable(v) else "",
)
def test_to_local_gradient(ranks, sbp, grad_sbp, expected):
    """The gradient flowing back through ``to_local`` is laid out as ``grad_sbp`` (default: the gradient layout
    of the tensor's SBP) and reaches the local parts accordingly."""
    p = st.placement("cpu", ranks)
    shape = (4, 3)
    grads = run_on_world(max(p.flat_ranks) + 1, to_local_grad_body, ranks, shape, sbp, grad_sbp)
    ws = [torch.full_like(g, float(r + 1)) for r, g in enumerate(grads)]
    for rank, grad in enumerate(grads):
        want = expected(ws[rank], ws)
        if want is None:  # (S(0), P) on [[0, 1], [2, 3]]: summed over the ranks of this mesh row
            row = [r for r in p.flat_ranks if p.coord_of(r)[0] == p.coord_of(rank)[0]]
            want = sum(ws[r] for r in row)
        torch.testing.assert_close(grad, want, msg=f"rank {rank}")


# ---------------------------------------------------------------------------------------------------------
# Ranks outside the placement


def outside_body(ranks, shapes, seed):
    """World of 3: members pass their part, non-members ``torch.empty(0)``; box through several layouts."""
    p = st.placement("cpu", ranks)
    parts = _parts(ranks, shapes, torch.float64, seed)
    x = _my_part(p, parts).requires_grad_()
    g = x.to_global(p, split(0))
    out = {"from_local": (g.to_local().detach(), g.full_tensor().detach())}
    for name, sbp in [("B", broadcast), ("S1", split(1)), ("P", partial_sum), ("Pmax", partial_max)]:
        h = g.to_global(sbp=sbp)
        out[name] = (h.sbp, h.to_local().detach(), h.full_tensor().detach())
    full = g.to_global(sbp=split(1)).to_global(sbp=partial_max).full_tensor()
    if p.coord_of(dist.get_rank()) is not None:
        (full * 3).sum().backward()
    out["grad"] = x.grad
    same = _parts(ranks, {c: (2, 3) for c in shapes}, torch.float64, seed + 1)  # broadcast/partial need equal shapes
    out["b_from_local"] = _my_part(p, same).to_global(p, broadcast).full_tensor()
    out["p_from_local"] = _my_part(p, same).to_global(p, partial_sum).full_tensor()
    mask = {c: t > 0 for c, t in same.items()}
    out["bool"] = _my_part(p, mask, torch.bool).to_global(p, partial_max).full_tensor()
    return out


@pytest.mark.parametrize(
    "ranks,shapes",
    [
        ([0, 2], {(0,): (3, 4), (1,): (1, 4)}),
        ([2, 0], {(0,): (2, 2), (1,): (2, 2)}),
        ([1], {(0,): (3, 5)}),
    ],
    ids=str,
)
def test_ranks_outside_the_placement(ranks, shapes):
    """On a world of 3, a placement of some of the ranks: members get the right values from to_global, boxing
    and full_tensor (and the right gradient), while non-members take part with ``torch.empty(0)`` and get
    empty local parts and empty full tensors."""
    results = run_on_world(3, outside_body, ranks, shapes, 0)
    p = st.placement("cpu", ranks)
    leaves = {c: t.requires_grad_() for c, t in _parts(ranks, shapes, torch.float64, 0).items()}
    logical = assemble(leaves, p.shape, (split(0),))
    (logical * 3).sum().backward()
    same = _parts(ranks, {c: (2, 3) for c in shapes}, torch.float64, 1)
    for rank, got in enumerate(results):
        coord = p.coord_of(rank)
        if coord is None:
            for key in ("from_local", "B", "S1", "P", "Pmax"):
                assert all(t.numel() == 0 for t in got[key] if isinstance(t, torch.Tensor)), key
            for key in ("b_from_local", "p_from_local", "bool"):
                assert got[key].numel() == 0, key
            assert got["grad"] is None or got["grad"].numel() == 0
            continue
        torch.testing.assert_close(got["from_local"][1], logical.detach())
        for key in ("B", "S1", "P", "Pmax"):
            assert got[key][0] == ({"B": broadcast, "S1": split(1), "P": partial_sum, "Pmax": partial_max}[key],)
            torch.testing.assert_close(got[key][2], logical.detach(), msg=key)
        torch.testing.assert_close(got["B"][1], logical.detach())
        meta = GlobalMeta(tuple(logical.shape), torch.float64, p, (split(1),))
        torch.testing.assert_close(got["S1"][1], expected_region(logical.detach(), meta, coord))
        torch.testing.assert_close(got["grad"], leaves[coord].grad)
        torch.testing.assert_close(got["b_from_local"], same[(0,)])
        torch.testing.assert_close(got["p_from_local"], sum(same.values()))
        assert torch.equal(got["bool"], torch.stack([t > 0 for t in same.values()]).any(0))


# ---------------------------------------------------------------------------------------------------------
# Bad input: every rank raises a clear exception, nobody hangs


def _bad_split_dim(rank, p, q):
    torch.ones(2, 3).to_global(p, split(2))


def _bad_sbp_length(rank, p, q):
    torch.ones(2, 3).to_global(p, (split(0), broadcast))


def _bad_bool_partial_sum(rank, p, q):
    torch.ones(2, dtype=torch.bool).to_global(p, partial_sum)


def _bad_concat_columns(rank, p, q):
    torch.ones(2, 4 if rank == 1 else 3).to_global(p, split(0))


def _bad_concat_ndim(rank, p, q):
    torch.ones((2, 3) if rank == 1 else (2,)).to_global(p, split(0))


def _bad_broadcast_shapes(rank, p, q):
    torch.ones(2 + rank).to_global(p, broadcast)


def _bad_meta_sbp(rank, p, q):
    torch.ones(2, 3).to_global(p, broadcast if rank == 1 else split(0))


def _bad_meta_sbp_no_split(rank, p, q):
    torch.ones(2, 3).to_global(p, partial_sum if rank else broadcast)


def _bad_meta_dtype(rank, p, q):
    torch.ones(2, 3, dtype=torch.float64 if rank == 1 else torch.float32).to_global(p, split(0))


def _bad_meta_placement(rank, p, q):
    torch.ones(2, 3).to_global(q if rank == 1 else p, split(0))


def _bad_box_meta(rank, p, q):
    g = torch.ones(4, 3).to_global(p, split(0))
    g.to_global(sbp=broadcast if rank == 1 else split(1), check_meta=True)


def _bad_duplicate_ranks(rank, p, q):
    st.placement("cpu", [0, 1, 0])


def _bad_ranks_outside_world(rank, p, q):
    st.placement("cpu", [[0, 1], [2, 7]])


def _bad_mix_plain_tensor(rank, p, q):
    torch.add(torch.ones(3).to_global(p, broadcast), torch.ones(3))


def _bad_mix_plain_tensor_operator(rank, p, q):
    torch.ones(3).to_global(p, split(0)) + torch.ones(3)


def _bad_mix_placements(rank, p, q):
    torch.ones(3).to_global(p, broadcast) + torch.ones(3).to_global(q, broadcast)


def _bad_cross_placement_device(rank, p, q):
    torch.ones(3).to_global(p, broadcast).to_global(st.placement("cuda", [2, 1, 0]), broadcast)


def _bad_cross_placement_sbp(rank, p, q):
    torch.ones(3).to_global(p, broadcast).to_global(st.placement("cpu", [[0, 1]]), split(0))


def error_body(name):
    """Every rank: run the bad call, catch what it raises; then all ranks run one more collective to show they
    are still in step."""
    p = st.placement("cpu", [0, 1, 2])
    q = st.placement("cpu", [2, 1, 0])
    try:
        globals()[name](dist.get_rank(), p, q)
        raised = None
    except Exception as err:  # noqa: BLE001 - the test inspects it
        raised = (type(err).__name__, str(err))
    after = torch.arange(3.0).to_global(p, partial_sum).full_tensor()
    return raised, after


BAD_INPUT = [
    ("_bad_split_dim", ValueError, ["split dim 2", "out of range"]),
    ("_bad_sbp_length", ValueError, ["2 entries", "1 axes"]),
    ("_bad_bool_partial_sum", TypeError, ["partial_sum", "bool"]),
    ("_bad_concat_columns", ValueError, ["cannot be concatenated", "rank 1", "dim 1"]),
    ("_bad_concat_ndim", ValueError, ["different numbers of dims"]),
    ("_bad_broadcast_shapes", ValueError, ["cannot be concatenated", "rank 1"]),
    ("_bad_meta_sbp", ValueError, ["different metadata", "rank 1"]),
    ("_bad_meta_sbp_no_split", ValueError, ["different metadata", "rank 1", "rank 2"]),
    ("_bad_meta_dtype", ValueError, ["different metadata", "rank 1", "float64"]),
    ("_bad_meta_placement", ValueError, ["different metadata", "rank 1", "(2, 1, 0)"]),
    ("_bad_box_meta", ValueError, ["different metadata", "rank 1"]),
    ("_bad_duplicate_ranks", ValueError, ["[0]", "more than once"]),
    ("_bad_ranks_outside_world", ValueError, ["[7]", "outside the world"]),
    ("_bad_mix_plain_tensor", st.MixedTensorError, ["plain tensor of shape (3,)", "to_global"]),
    ("_bad_mix_plain_tensor_operator", st.MixedTensorError, ["plain tensor of shape (3,)", "implicit_broadcast"]),
    ("_bad_mix_placements", ValueError, ["different placements", "ranks=[0, 1, 2]", "ranks=[2, 1, 0]"]),
    ("_bad_cross_placement_device", ValueError, ["device types differ", "'cpu'", "'cuda'", "ranks=[2, 1, 0]"]),
    ("_bad_cross_placement_sbp", ValueError, ["1 entries", "2 axes", "ranks=[0, 1, 2]", "ranks=[[0, 1]]"]),
]


@pytest.mark.parametrize("name,error,words", BAD_INPUT, ids=[b[0][5:] for b in BAD_INPUT])
def test_bad_input_raises_on_every_rank(name, error, words):
    """Each bad call raises ``error`` on all three ranks, with a message naming the problem, and leaves the
    ranks in step (a rank that raised alone would leave the others blocked: the test would time out)."""
    results = run_on_world(3, error_body, name, _timeout=ERROR_TIMEOUT)
    for rank, (raised, after) in enumerate(results):
        assert raised is not None, f"rank {rank} did not raise"
        kind, message = raised
        assert kind == error.__name__, f"rank {rank}: {kind}: {message}"
        for word in words:
            assert word in message, f"rank {rank}: {word!r} not in {message!r}"
        torch.testing.assert_close(after, torch.arange(3.0) * 3)


def scalar_operands_body():
    """Python scalars and 0-dim plain tensors may be mixed with global tensors of any layout."""
    p = st.placement("cpu", [0, 1])
    rank = dist.get_rank()
    out = {}
    for name, sbp in [("S0", split(0)), ("B", broadcast), ("P", partial_sum), ("Pmax", partial_max)]:
        g = torch.arange(4.0).add(rank).to_global(p, sbp)
        out[name] = [
            (g + 2).full_tensor(),
            (g * torch.tensor(3.0)).full_tensor(),
            (torch.tensor(1.5) - g).full_tensor(),
            torch.add(g, torch.tensor(2.0), alpha=2).full_tensor(),
        ]
    return out


def test_python_scalar_and_zero_dim_tensor_operands():
    """``g + 2``, ``g * tensor(3.)``, ``tensor(1.5) - g`` and ``add(g, tensor(2.), alpha=2)`` give the right value
    for split, broadcast and partial layouts."""
    results = run_on_world(2, scalar_operands_body)
    parts = [torch.arange(4.0), torch.arange(4.0) + 1]
    logical = {"S0": torch.cat(parts), "B": parts[0], "P": parts[0] + parts[1], "Pmax": parts[1]}
    for got in results:
        for name, x in logical.items():
            want = [x + 2, x * 3, 1.5 - x, x + 4]
            for g, w in zip(got[name], want):
                torch.testing.assert_close(g, w, msg=name)


def full_tensor_mixed_body():
    """Every rank: a loss that adds a plain 0-dim value computed from ``full_tensor`` to a global one."""
    p = st.placement("cpu", [0, 1])
    x = torch.ones(3 if dist.get_rank() == 0 else 1, 2, requires_grad=True)  # unbalanced parts
    g = x.to_global(p, split(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = (g * 3).sum() + (g.full_tensor() * 2).sum()  # global 0-dim + plain 0-dim
    loss.backward()
    return loss.full_tensor().detach(), x.grad


def test_gradient_through_full_tensor_used_as_zero_dim_operand():
    """When a plain 0-dim tensor from ``full_tensor`` is combined with global tensors, its gradient arrives as a
    global tensor; ``full_tensor``'s backward still gives every part its gradient (3 + 2)."""
    (loss0, grad0), (loss1, grad1) = run_on_world(2, full_tensor_mixed_body)
    torch.testing.assert_close(loss0, torch.tensor(40.0))
    torch.testing.assert_close(loss1, torch.tensor(40.0))
    torch.testing.assert_close(grad0, torch.full((3, 2), 5.0))
    torch.testing.assert_close(grad1, torch.full((1, 2), 5.0))
