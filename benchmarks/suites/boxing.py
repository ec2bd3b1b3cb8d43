"""Boxing: every SBP transition, timed for sbp_torch, DTensor's ``redistribute`` and the bare collectives.

Transitions: all 20 ordered pairs of ``S(0)``, ``S(1)``, ``B``, ``P`` (sum) and ``P(max)`` on a 1-D placement
(2 ranks, then 4), and common 2-D ones on a 2x2 placement. Tensors are float32 matrices of 4 KB to 64 MB
whose rows and columns are both uneven (``2^k + 1`` rows and ``2^m - 1`` columns, so no split divides
evenly on 2 or 4 ranks).

Per transition and size:

* **sbp_torch**: ``x.to_global(sbp=dst)``;
* **DTensor**: ``x.redistribute(mesh, dst)`` on the same ranks (the same process groups: a DTensor mesh's);
  DTensor's uneven shards follow ``torch.chunk``, sbp_torch's are balanced, so local parts can differ by a row.
  The public ``redistribute`` refuses every change *to* a partial placement ("for internal use only"); those
  rows time the internal ``Redistribute`` function that DTensor's ops use instead, marked † in the report;
* **bare**: the ``torch.distributed`` collectives that sbp_torch's plan names (``all_gather_into_tensor``,
  ``all_to_all_single``, ``all_reduce``, ``reduce_scatter_tensor``) on plain preallocated tensors in the same
  groups, with every part padded to the largest one (these collectives need equal parts), or, for a
  point-to-point plan, ``batch_isend_irecv`` of the same pieces: the floor for running that plan. A
  transition whose plan is local has no bare time;
* **bytes**: what sbp_torch's plan sends (``boxing_plan(x, dst).bytes_sent``, summed over all ranks) beside
  the theoretical minimum (``min_bytes``, derived below without the planner);
* **view**: whether the result's local part lies in the source's storage (a ``B -> S`` slice can be a view).

Timing is ``harness.timed``: all ranks start each call together and a call's time is the slowest rank's.
Before timing, each library's result is compared once with the logical tensor (``full_tensor()`` against
the plain value), so a wrong fast path cannot produce a good number; a wrong or unsupported transition is
reported and not timed.

Minimum bytes (``min_bytes``), for one element, in a model where a message carries one element's value
(no coding across elements), summed over elements and times the item size:

* the *holders* of an element are the ranks whose source part contains it; along partial axes they hold
  different addends: ``k`` distinct addends (``k = 1`` when the source has no partial axis);
* the *needers* ``T`` are the ranks whose destination part must hold its value; with a partial destination,
  one destination class (ranks with the same coordinates on the partial axes) may hold the value and the
  others the reduction's identity, so ``T`` is the cheapest such class;
* with ``k = 1`` every needer that is not a holder must receive the value once: ``|T - holders|``;
* with ``k > 1`` the addends must meet: the graph of messages must connect the ``k`` addends, else the
  result would split into independent functions of the unconnected addends, which neither sum nor max
  allows: ``k - 1`` messages; then every needer but one that already took part receives it:
  ``|T| - 1`` more (``|T|`` if no needer holds an addend). With ``T`` everyone this is the gossip bound
  ``2k - 2`` of an all-reduce; with one needer it is a reduce's ``k - 1``.

For 1-D this gives ``(p-1)N`` for an all-gather, ``2(p-1)N`` for an all-reduce, ``(p-1)N`` for a
reduce-scatter or a change of partial op, and 0 for ``B -> S``, ``B -> P``, ``S -> P``, with ``N`` the tensor's
bytes.
"""

from __future__ import annotations

import gc
import itertools
import math
import zlib

import torch
import torch.distributed as dist

from benchmarks import harness
from sbp_torch._boxing.plan import POINT_TO_POINT

TITLE = "Boxing: SBP transitions, sbp_torch beside DTensor and bare collectives"
WORLDS = [2, 4]

SIZES = [  # (label, shape): float32, both dims uneven on 2 and 4 ranks
    ("4 KB", (33, 31)),
    ("64 KB", (129, 127)),
    ("1 MB", (513, 511)),
    ("16 MB", (2049, 2047)),
    ("64 MB", (4097, 4095)),
]
QUICK_SIZES = ["4 KB", "1 MB"]
ONE_D = ["S0", "S1", "B", "P", "Pmax"]
TWO_D = [
    (("S0", "S1"), ("B", "B")),
    (("P", "P"), ("B", "B")),
    (("S0", "B"), ("B", "S0")),
    (("P", "S0"), ("S0", "S1")),
    (("S0", "S1"), ("S1", "S0")),
    (("B", "B"), ("S0", "S1")),
]


def _transitions(mesh_shape: tuple[int, ...]) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    if len(mesh_shape) == 2:
        return TWO_D
    return [((a,), (b,)) for a, b in itertools.permutations(ONE_D, 2)]


# ---- layouts, without the planner ----------------------------------------------------------------------


def _balanced(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of part ``index`` of ``n`` rows in ``parts`` balanced parts (the first get one more)."""
    base, extra = divmod(n, parts)
    return index * base + min(index, extra), base + (1 if index < extra else 0)


def region(shape, mesh_shape, coord, layout) -> list[tuple[int, int]]:
    """(start, length) per dim of the part at ``coord``; splits nest in axis order, partial keeps the whole."""
    box = [(0, n) for n in shape]
    for axis, token in enumerate(layout):
        if token.startswith("S"):
            d = int(token[1:])
            start, length = box[d]
            offset, length = _balanced(length, mesh_shape[axis], coord[axis])
            box[d] = (start + offset, length)
    return box


def _coords(mesh_shape):
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def _partial_axes(layout) -> list[int]:
    return [a for a, t in enumerate(layout) if t.startswith("P")]


def min_bytes(shape, itemsize: int, mesh_shape, src, dst) -> int:
    """Fewest bytes all ranks together must send to take a tensor from layout ``src`` to ``dst`` (module
    docstring). Works on cells: the blocks cut by every rank's source and destination region boundaries,
    inside which every element has the same holders and needers."""
    coords = _coords(mesh_shape)
    src_regions = {c: region(shape, mesh_shape, c, src) for c in coords}
    dst_regions = {c: region(shape, mesh_shape, c, dst) for c in coords}
    src_p, dst_p = _partial_axes(src), _partial_axes(dst)
    if src_p and dst_p and any(src[a] == dst[a] for a in dst_p):
        raise NotImplementedError("a partial axis kept as partial is not modelled")
    cuts = []
    for d, n in enumerate(shape):
        points = {0, n}
        for box in itertools.chain(src_regions.values(), dst_regions.values()):
            points |= {box[d][0], box[d][0] + box[d][1]}
        cuts.append(sorted(points))

    def contains(box, cell):
        return all(b0 <= c0 and c0 + cl <= b0 + bl for (b0, bl), (c0, cl) in zip(box, cell))

    messages = 0
    for cell in itertools.product(*[[(a, b - a) for a, b in zip(c, c[1:]) if b > a] for c in cuts]):
        holders = {c for c in coords if contains(src_regions[c], cell)}
        addends = len({tuple(c[a] for a in src_p) for c in holders})
        needers = [c for c in coords if contains(dst_regions[c], cell)]
        classes = {}  # destination classes: one of them holds the value, the others the identity
        for c in needers:
            classes.setdefault(tuple(c[a] for a in dst_p), set()).add(c)
        best = None
        for group in classes.values():
            if addends == 1:
                cost = len(group - holders)
            else:
                cost = addends - 1 + len(group) - (1 if group & holders else 0)
            best = cost if best is None else min(best, cost)
        messages += best * math.prod(length for _, length in cell)
    return messages * itemsize


# ---- building inputs -----------------------------------------------------------------------------------


def _token(sbp) -> str:
    from sbp_torch.sbp import Broadcast, Partial

    if isinstance(sbp, Broadcast):
        return "B"
    if isinstance(sbp, Partial):
        return "P" if sbp.op == "sum" else "P" + sbp.op
    return f"S{sbp.dim}"


def _addend(grid: harness.RankGrid, full: torch.Tensor, layout) -> torch.Tensor:
    """This rank's full-shape value under the partial axes of ``layout`` (``full`` itself if none): sum addends
    ``full / k`` plus offsets that cancel; max addends ``full - c``, so class 0 holds the max."""
    axes = _partial_axes(layout)
    if not axes:
        return full
    ops = {layout[a] for a in axes}
    assert len(ops) == 1, "mixed partial ops are not built here"
    k = math.prod(grid.shape[a] for a in axes)
    c = 0
    for a in axes:
        c = c * grid.shape[a] + grid.coord[a]
    if ops == {"P"}:
        return full / k + (c - (k - 1) / 2) * 0.25
    return full - float(c)


def _inputs(grid: harness.RankGrid, full: torch.Tensor, layout):
    """The sbp_torch tensor and the DTensor of logical value ``full`` with ``layout``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    value = _addend(grid, full, layout)
    box = region(full.shape, grid.shape, grid.coord, layout)
    local = value[tuple(slice(s, s + n) for s, n in box)].contiguous()
    ours = local.to_global(grid.placement, tuple(map(harness.sbp, layout)), check_meta=False)
    plain = [harness.dtensor_placement("B" if t.startswith("P") else t) for t in layout]
    their_local = distribute_tensor(value, grid.mesh, plain, src_data_rank=None).to_local()
    theirs = DTensor.from_local(
        their_local,
        grid.mesh,
        [harness.dtensor_placement(t) for t in layout],
        run_check=False,
        shape=full.shape,
        stride=full.stride(),
    )
    return ours, theirs


# ---- bare collectives ----------------------------------------------------------------------------------

# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (the old names warn)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _bare(grid: harness.RankGrid, shape, plan):
    """A function running, on plain tensors in the mesh's groups, the collectives of ``plan``'s steps with
    the sizes they move (parts padded to the largest); None when every step is local."""
    calls = []
    cur = [_token(s) for s in plan.meta.sbp]
    for step in plan.steps:
        if step.collective == POINT_TO_POINT:  # every axis at once: the same pieces, sent and received
            calls.append(_bare_point_to_point(step.pieces))
            cur = [_token(s) for s in step.dst]
            continue
        p, group = grid.shape[step.axis], grid.mesh.get_group(step.axis)
        shared = cur.copy()
        shared[step.axis] = "B"
        extent = math.prod(n for _, n in region(shape, grid.shape, grid.coord, shared))  # the group's piece
        part = -(-extent // p)
        op = dist.ReduceOp.MAX if _token(step.src) == "Pmax" else dist.ReduceOp.SUM
        if step.collective == "all-gather":
            src, out = torch.randn(part), torch.empty(part * p)
            calls.append(lambda out=out, src=src, g=group: _ALL_GATHER(out, src, group=g))
        elif step.collective == "all-to-all":
            n = p * -(-part // p)
            src, out = torch.randn(n), torch.empty(n)
            calls.append(lambda out=out, src=src, g=group: dist.all_to_all_single(out, src, group=g))
        elif step.collective == "all-reduce":
            buf = torch.randn(extent)
            calls.append(lambda buf=buf, g=group, op=op: dist.all_reduce(buf, op=op, group=g))
        elif step.collective == "reduce-scatter":
            src, out = torch.randn(part * p), torch.empty(part)
            calls.append(lambda out=out, src=src, g=group, op=op: _REDUCE_SCATTER(out, src, op=op, group=g))
        elif not step.collective.startswith("local"):
            raise ValueError(f"no bare collective for {step.collective}")
        cur[step.axis] = _token(step.dst)
    if not calls:
        return None

    def run():
        for call in calls:
            call()

    return run


def _step_label(step) -> str:
    if step.collective == POINT_TO_POINT:
        src, dst = (",".join(_token(s) for s in sbp) for sbp in (step.src, step.dst))
        return f"every axis: ({src})->({dst}) {step.collective}"
    return f"axis {step.axis}: {_token(step.src)}->{_token(step.dst)} {step.collective}"


def _bare_point_to_point(pieces):
    """``batch_isend_irecv`` of this rank's pieces (plain preallocated tensors), as the plan's step posts them."""
    me = dist.get_rank()
    mine = [(p, tag) for tag, p in enumerate(pieces) if not p.is_local and me in (p.src, p.dst)]
    buffers = [(torch.randn(p.lengths) if p.src == me else torch.empty(p.lengths), p, tag) for p, tag in mine]

    def run():
        ops = [
            dist.P2POp(dist.isend if p.src == me else dist.irecv, buf, p.dst if p.src == me else p.src, tag=tag)
            for buf, p, tag in buffers
        ]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()

    return run


# ---- measuring -----------------------------------------------------------------------------------------


def _is_view(out: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``out``'s data lies inside ``src``'s storage."""
    storage = src.untyped_storage()
    start = storage.data_ptr()
    return out.numel() > 0 and start <= out.data_ptr() < start + storage.nbytes()


def _check(got: torch.Tensor, full: torch.Tensor) -> str | None:
    """None when ``got`` is ``full`` (up to the rounding of partial sums), else why not."""
    try:
        torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
        return None
    except AssertionError as err:
        return "wrong result: " + str(err).strip().splitlines()[0][:100]


def _dtensor_route(x, placements):
    """(function, name) that redistributes ``x``: the public ``redistribute``, or, for a partial target
    that it refuses ("for internal use only"), the internal ``Redistribute`` function that DTensor's own ops
    use, with the arguments ``redistribute`` would pass."""
    if not any(p.is_partial() and p != q for p, q in zip(placements, x.placements)):
        return (lambda t, mesh, pl: t.redistribute(mesh, pl)), "public"
    from torch.distributed.tensor._redistribute import Redistribute

    def internal(t, mesh, pl):
        dtype = t.to_local().dtype
        options = {"op_dtype": dtype, "out_dtype": dtype, "backward_options": {"op_dtype": dtype, "out_dtype": dtype}}
        return Redistribute.apply(t, mesh, tuple(pl), False, options)

    return internal, "internal"


def _repeats(nbytes: int, quick: bool) -> tuple[int, int]:
    """(repeats, warm-up calls) for a tensor of ``nbytes``."""
    if quick:
        return (10, 2) if nbytes < 2**22 else (4, 1)
    if nbytes <= 2**20:
        return 40, 5
    return (12, 2) if nbytes <= 2**24 else (6, 1)


def _case(grid: harness.RankGrid, src, dst, label, shape, quick) -> dict:
    import sbp_torch as st

    gen = torch.Generator().manual_seed(zlib.crc32(repr((src, dst, shape)).encode()))  # the same on every rank
    full = torch.randn(shape, generator=gen)
    ours, theirs = _inputs(grid, full, src)
    dst_sbp = tuple(map(harness.sbp, dst))
    dst_dt = [harness.dtensor_placement(t) for t in dst]
    plan = st.boxing_plan(ours, dst_sbp)
    row = {
        "mesh": grid.name,
        "src": list(src),
        "dst": list(dst),
        "size": label,
        "shape": list(shape),
        "nbytes": full.numel() * full.element_size(),
        "plan": [_step_label(s) for s in plan.steps],
        "bytes_sbp": plan.bytes_sent,
        "bytes_min": min_bytes(shape, full.element_size(), grid.shape, src, dst),
    }
    repeats, warmup = _repeats(row["nbytes"], quick)

    out = ours.to_global(sbp=dst_sbp)
    row["sbp_error"] = _check(out.full_tensor(), full)
    row["sbp_view"] = _is_view(out.to_local(), ours.to_local())
    del out
    if row["sbp_error"] is None:
        row["sbp"] = harness.timed(lambda: ours.to_global(sbp=dst_sbp), repeats, warmup)

    redistribute, row["dtensor_route"] = _dtensor_route(theirs, dst_dt)
    try:
        out = redistribute(theirs, grid.mesh, dst_dt)
        row["dtensor_error"] = _check(out.full_tensor(), full)
        row["dtensor_view"] = _is_view(out.to_local(), theirs.to_local())
        del out
    except Exception as err:  # an unsupported transition raises on every rank alike
        row["dtensor_error"] = f"unsupported: {type(err).__name__}: {str(err).strip().splitlines()[0][:100]}"
    if row["dtensor_error"] is None:
        row["dtensor"] = harness.timed(lambda: redistribute(theirs, grid.mesh, dst_dt), repeats, warmup)

    bare = _bare(grid, shape, plan)
    if bare is not None:
        row["bare"] = harness.timed(bare, repeats, warmup)
    return row


def measure(world: int, quick: bool) -> list[dict]:
    sizes = [s for s in SIZES if not quick or s[0] in QUICK_SIZES]
    rows = []
    for mesh_shape in harness.meshes(world):
        grid = harness.RankGrid(mesh_shape)
        for src, dst in _transitions(mesh_shape):
            for label, shape in sizes:
                rows.append(_case(grid, src, dst, label, shape, quick))
                gc.collect()
    return rows


# ---- report --------------------------------------------------------------------------------------------


def _name(layout) -> str:
    text = ", ".join(t.replace("Pmax", "P(max)") for t in layout)
    return f"({text})" if len(layout) > 1 else text


def _transition(row) -> str:
    return f"{_name(row['src'])} → {_name(row['dst'])}"


def _bytes(n: int) -> str:
    for unit, scale in (("MB", 2**20), ("KB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _within(rows, key, limit) -> tuple[int, int]:
    pairs = [(r["sbp"]["median_us"], r[key]["median_us"]) for r in rows if r.get("sbp") and r.get(key)]
    return sum(a <= limit * b for a, b in pairs), len(pairs)


def report(rows: list[dict]) -> str:
    parts = [
        "Time of one transition in µs (ms where marked): median (first–third quartile) of the slowest rank;",
        "float32, both dims uneven. Bytes are summed over all ranks: sbp_torch's plan and the theoretical",
        "minimum (`min_bytes` in `benchmarks/suites/boxing.py`). *bare* runs the collectives of sbp_torch's plan on",
        "plain tensors in the same groups (— where the plan is local). *view*: the result's local part lies in",
        "the source's storage (sbp_torch / DTensor). †: DTensor's public `redistribute` refuses this transition",
        '(a partial target is "for internal use only"); the time is its internal `Redistribute`. Targets:',
        "sbp_torch ≤ 1.0x DTensor, ≤ 1.2x bare, bytes = minimum.",
        "",
        "## Summary",
        "",
    ]
    summary = []
    for mesh in dict.fromkeys(r["mesh"] for r in rows):
        mine = [r for r in rows if r["mesh"] == mesh]
        dt_ok, dt_n = _within(mine, "dtensor", 1.0)
        bare_ok, bare_n = _within(mine, "bare", 1.2)
        over = {_transition(r) for r in mine if r["bytes_sbp"] != r["bytes_min"]}
        unsupported = sorted({_transition(r) for r in mine if r.get("dtensor_error")})
        wrong = sorted({_transition(r) for r in mine if r.get("sbp_error")})
        summary.append(
            [
                mesh,
                f"{dt_ok} / {dt_n}",
                f"{bare_ok} / {bare_n}",
                f"{len({_transition(r) for r in mine}) - len(over)} / {len({_transition(r) for r in mine})}",
                ", ".join(sorted(over)) or "—",
                ", ".join(unsupported) or "—",
                ", ".join(wrong) or "—",
            ]
        )
    parts += [
        harness.markdown_table(
            [
                "placement",
                "≤ 1.0x DTensor",
                "≤ 1.2x bare",
                "transitions at min bytes",
                "above min bytes",
                "DTensor unsupported / wrong",
                "sbp_torch wrong",
            ],
            summary,
        ),
        "",
    ]
    for mesh in dict.fromkeys(r["mesh"] for r in rows):
        parts += [f"## Placement {mesh}", ""]
        table = []
        for r in (r for r in rows if r["mesh"] == mesh):
            unit = "ms" if r["nbytes"] > 2**21 else "us"
            table.append(
                [
                    _transition(r),
                    f"{r['size']} {tuple(r['shape'])}",
                    harness.fmt(r.get("sbp"), unit) if not r.get("sbp_error") else "wrong",
                    (harness.fmt(r.get("dtensor"), unit) + (" †" if r.get("dtensor_route") == "internal" else ""))
                    if not r.get("dtensor_error")
                    else r["dtensor_error"].split(":")[0],
                    harness.fmt(r.get("bare"), unit),
                    harness.ratio(r.get("sbp"), r.get("dtensor")),
                    harness.ratio(r.get("sbp"), r.get("bare")),
                    _bytes(r["bytes_sbp"]),
                    _bytes(r["bytes_min"]),
                    f"{r['bytes_sbp'] / r['bytes_min']:.2f}x"
                    if r["bytes_min"]
                    else ("=" if not r["bytes_sbp"] else "∞"),
                    f"{'yes' if r['sbp_view'] else 'no'} / "
                    + ("—" if r.get("dtensor_error") else ("yes" if r["dtensor_view"] else "no")),
                ]
            )
        parts += [
            harness.markdown_table(
                [
                    "transition",
                    "size",
                    "sbp_torch",
                    "DTensor",
                    "bare",
                    "sbp/DT",
                    "sbp/bare",
                    "bytes sbp_torch",
                    "min bytes",
                    "bytes/min",
                    "view",
                ],
                table,
            ),
            "",
        ]
        plans = {}
        for r in rows:
            if r["mesh"] == mesh:
                plans.setdefault(_transition(r), "; ".join(r["plan"]) or "nothing")
        parts += ["Plans: " + " · ".join(f"{t}: {p}" for t, p in plans.items()), ""]
    errors = sorted({(r["mesh"], _transition(r), r["dtensor_error"]) for r in rows if r.get("dtensor_error")})
    if errors:
        parts += ["## DTensor errors", ""] + [f"- {m} {t}: {e}" for m, t, e in errors] + [""]
    wrong = sorted({(r["mesh"], _transition(r), r["sbp_error"]) for r in rows if r.get("sbp_error")})
    if wrong:
        parts += ["## sbp_torch errors", ""] + [f"- {m} {t}: {e}" for m, t, e in wrong] + [""]
    return "\n".join(parts)


def plot(rows: list[dict], path: str) -> None:
    """Time against size (log-log), one panel per transition; colour per library, line style per placement."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(_transition(r) for r in rows))
    meshes = list(dict.fromkeys(r["mesh"] for r in rows))
    styles = dict(zip(meshes, ["-", "--", ":", "-."]))
    colors = {"sbp": "#1f77b4", "dtensor": "#ff7f0e", "bare": "#2ca02c"}
    labels = {"sbp": "sbp_torch", "dtensor": "DTensor", "bare": "bare"}
    cols = 5
    fig, axes = plt.subplots(
        -(-len(names) // cols), cols, figsize=(3.4 * cols, 2.8 * -(-len(names) // cols)), squeeze=False
    )
    for ax, name in zip(axes.flat, names):
        for mesh in meshes:
            mine = [r for r in rows if r["mesh"] == mesh and _transition(r) == name]
            for key in ("sbp", "dtensor", "bare"):
                points = [(r["nbytes"], r[key]["median_us"]) for r in mine if r.get(key)]
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, styles[mesh], color=colors[key], marker=".", label=f"{labels[key]}, {mesh}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(name, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(names) :]:
        ax.axis("off")
    handles = {}
    for ax in axes.flat:
        for h, t in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(t, h)
    fig.legend(list(handles.values()), list(handles.keys()), loc="lower right", fontsize=8, ncol=3)
    fig.supxlabel("tensor bytes")
    fig.supylabel("µs per transition")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
