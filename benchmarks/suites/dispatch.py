"""Per-op time of sbp_torch beside DTensor: the dispatch cost on a cache hit and on a cache miss.

Thirteen everyday ops (add, mul, relu, gelu, mm, linear, view, transpose, sum(dim), softmax, layer_norm, cat
and the in-place add_) run on a 1-D placement of 2 ranks, of 4 ranks, and on a 2x2 placement (the 4-rank
launch measures both). Each library gets the same process group, the same shapes and the same local parts:
activations are split along the batch dim (``S(0)`` / ``Shard(0)``; on 2x2 ``(S(0), S(1))``, batch and
sequence), weights broadcast (``B`` / ``Replicate``; on 2x2 ``mm`` and ``linear`` are column-parallel, the
weight split on the second axis), so that both can run each op on the local parts without moving data. The
``comm`` column counts the collectives one call issued, which shows whether that held.

What is timed, per op:

* **floor**: the plain torch op on this rank's local parts, the least any wrapper can cost;
* **hit**: the op on the same global inputs again and again, so every decision is cached (sbp_torch's
  signature cache, DTensor's sharding-propagation cache). The inputs do not require grad, so autograd
  records nothing, as in inference and optimizer steps: sbp_torch runs such calls as *local calls*, the
  torch function on the local parts, without entering ``__torch_dispatch__`` (``sbp_torch/_frontend/_local_calls.py``);
* **hit, grad**: the same with inputs that require grad, so autograd records every call, as in a training
  forward: both libraries then take their dispatch path (not timed for the in-place op, which torch refuses
  on a leaf that requires grad);
* **miss**: the op on inputs of a shape neither library has seen: ``MISS_SHAPES`` distinct shapes (the
  sequence length, or the rows of ``mm``/``linear``, grows by 2 or 4 per shape) are built before the timed
  region and each timed call takes the next one. The op itself was seen before (the hit measurement ran
  first), so a miss is the price of a new shape, as in training with a variable sequence length.

Method: floor and hit ops take microseconds, so one sample times ``LOOP`` back-to-back calls and divides by ``LOOP``;
the floor, sbp_torch and DTensor take turns sample by sample, so that a drift in the machine's speed (it is shared)
falls on all three alike. A miss takes milliseconds and is timed one call per sample. Ranks start each measurement
together (a barrier) but are not synchronised per sample, since the ops are local. Each rank summarises its own
samples (median and quartiles); the table shows the rank with the largest median, as the slowest rank sets the pace of
a distributed step. Before anything is timed, one call of each op is checked against the plain torch op on the full
tensors, for both libraries, so a wrong fast path cannot produce a good number.
"""

from __future__ import annotations

import gc
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks import harness

TITLE = "Dispatch: per-op time on global tensors, sbp_torch beside DTensor"
WORLDS = [2, 4]

LOOP = 20  # calls per sample for the microsecond-scale measurements
BATCH, SEQ, HIDDEN = 8, 32, 64  # activations (batch, sequence, hidden); 64 KB in float32
ROWS, K, N = 128, 64, 64  # mm / linear: x (ROWS, K) @ w (K, N)

# Layout of each kind of input, per placement rank (1-D, 2-D), as tokens shared by both libraries.
LAYOUTS = {
    "act": {1: ("S0",), 2: ("S0", "S1")},
    "vec": {1: ("B",), 2: ("B", "B")},  # a (HIDDEN,) weight of mul / layer_norm
    "x2": {1: ("S0",), 2: ("S0", "B")},  # the input of mm / linear
    "w_mm": {1: ("B",), 2: ("B", "S1")},  # (K, N), column-parallel on 2x2
    "w_lin": {1: ("B",), 2: ("B", "S0")},  # (N, K), linear's weight: column-parallel on 2x2
    "b_lin": {1: ("B",), 2: ("B", "S0")},  # (N,)
}


def _shape(kind: str, i: int) -> tuple[int, ...]:
    """The shape of an input of ``kind`` in variant ``i`` (-1: the base shape; 0, 1, ...: fresh shapes)."""
    grow = i + 1
    return {
        "act": (BATCH, SEQ + 2 * grow, HIDDEN),
        "vec": (HIDDEN,),
        "x2": (ROWS + 4 * grow, K),
        "w_mm": (K, N),
        "w_lin": (N, K),
        "b_lin": (N,),
    }[kind]


# (name, input kinds, function); every function works on plain, sbp_torch and DTensor tensors alike.
CASES = [
    ("add", ["act", "act"], lambda x, y: x + y),
    ("mul", ["act", "vec"], lambda x, w: x * w),
    ("relu", ["act"], torch.relu),
    ("gelu", ["act"], F.gelu),
    ("mm", ["x2", "w_mm"], torch.mm),
    ("linear", ["x2", "w_lin", "b_lin"], F.linear),
    ("view", ["act"], lambda x: x.view(x.shape[0], x.shape[1], 4, x.shape[2] // 4)),
    ("transpose", ["act"], lambda x: x.transpose(1, 2)),
    ("sum(dim=-1)", ["act"], lambda x: x.sum(dim=-1)),
    ("softmax", ["act"], lambda x: torch.softmax(x, dim=-1)),
    ("layer_norm", ["act", "vec", "vec"], lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b)),
    ("cat", ["act", "act"], lambda x, y: torch.cat([x, y], dim=-1)),
    ("add_", ["act", "act"], lambda x, y: x.add_(y)),
]


def _local_part(grid: harness.RankGrid, full: torch.Tensor, layout: tuple[str, ...]) -> torch.Tensor:
    """This rank's part: splits nest in axis order (the shapes here divide evenly, so both libraries agree on it)."""
    part = full
    for axis, token in enumerate(layout):
        if token != "B":
            part = part.tensor_split(grid.shape[axis], dim=int(token[1:]))[grid.coord[axis]]
    return part.contiguous()


def _inputs(grid: harness.RankGrid, kinds: list[str], i: int, seed: int):
    """(full tensors, sbp_torch tensors, DTensors, local parts) of variant ``i``, one per kind."""
    from torch.distributed.tensor import DTensor

    gen = torch.Generator().manual_seed(seed)  # the same values on every rank
    fulls, ours, theirs, locals_ = [], [], [], []
    for kind in kinds:
        layout = LAYOUTS[kind][len(grid.shape)]
        full = torch.randn(_shape(kind, i), generator=gen)
        local = _local_part(grid, full, layout)
        fulls.append(full)
        locals_.append(local)
        ours.append(local.clone().to_global(grid.placement, tuple(map(harness.sbp, layout)), check_meta=False))
        theirs.append(
            DTensor.from_local(
                local.clone(),
                grid.mesh,
                [harness.dtensor_placement(t) for t in layout],
                run_check=False,
                shape=full.shape,
                stride=full.stride(),
            )
        )
    return fulls, ours, theirs, locals_


def _collectives(fn, args) -> int:
    """How many collectives one call of ``fn`` runs on this rank: the backend's events in the profiler.
    (DTensor's ``CommDebugMode`` cannot see collectives issued inside another subclass's dispatch.)"""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(*args)
    return sum(e.name.startswith(("gloo:", "nccl:")) for e in prof.events())


def _check(name: str, fn, fulls, ours, theirs) -> None:
    expected = fn(*[f.clone() for f in fulls])
    got_ours = fn(*ours).full_tensor()
    got_theirs = fn(*theirs).full_tensor()
    torch.testing.assert_close(got_ours, expected, msg=lambda m: f"sbp_torch {name}: {m}")
    torch.testing.assert_close(got_theirs, expected, msg=lambda m: f"DTensor {name}: {m}")


def _loop_timed(fn, variants: list, repeats: int) -> list[dict]:
    """Median and quartiles (µs per call) of ``repeats`` samples of ``LOOP`` calls of ``fn`` on each of
    ``variants`` (argument lists). The variants take turns sample by sample, so that a machine whose speed
    drifts during the measurement slows all of them alike."""
    for args in variants:
        for _ in range(LOOP):
            fn(*args)
    gc.collect()
    dist.barrier()
    samples = [[] for _ in variants]
    for _ in range(repeats):
        for args, mine in zip(variants, samples):
            start = time.perf_counter_ns()
            for _ in range(LOOP):
                fn(*args)
            mine.append((time.perf_counter_ns() - start) / 1e3 / LOOP)
    return [harness.summary(mine) for mine in samples]


def _requiring_grad(tensors: list) -> list:
    """Leaves with the same values that require grad."""
    return [t.detach().requires_grad_() for t in tensors]


def _miss_timed(fn, variants: list) -> dict:
    """Median and quartiles (µs) of one call on each of ``variants``, inputs of shapes not seen before."""
    gc.collect()
    dist.barrier()
    samples = []
    for args in variants:
        start = time.perf_counter_ns()
        fn(*args)
        samples.append((time.perf_counter_ns() - start) / 1e3)
    return harness.summary(samples)


def _slowest(stat: dict) -> dict:
    """The summary of the rank with the largest median."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, stat)
    return max(every, key=lambda s: s["median_us"])


def measure(world: int, quick: bool) -> list[dict]:
    repeats, misses = (15, 8) if quick else (60, 30)
    rows = []
    for mesh_shape in harness.meshes(world):
        grid = harness.RankGrid(mesh_shape)
        for seed, (name, kinds, fn) in enumerate(CASES):
            fulls, ours, theirs, locals_ = _inputs(grid, kinds, -1, seed)
            _check(name, fn, fulls, ours, theirs)  # also the first call: the op is known to both from here on
            row = {
                "mesh": grid.name,
                "op": name,
                "layout": " · ".join("(" + ", ".join(LAYOUTS[k][len(mesh_shape)]) + ")" for k in kinds),
                "shapes": [list(f.shape) for f in fulls],
                "comm_sbp": _collectives(fn, ours),
                "comm_dtensor": _collectives(fn, theirs),
            }
            floor, ours_hit, theirs_hit = _loop_timed(fn, [locals_, ours, theirs], repeats)
            row["floor"], row["sbp_hit"], row["dtensor_hit"] = map(_slowest, (floor, ours_hit, theirs_hit))
            if not name.endswith("_"):
                ours_grad, theirs_grad = _loop_timed(fn, [_requiring_grad(ours), _requiring_grad(theirs)], repeats)
                row["sbp_hit_grad"], row["dtensor_hit_grad"] = _slowest(ours_grad), _slowest(theirs_grad)
            fresh = [_inputs(grid, kinds, i, 1000 + i) for i in range(misses)]
            row["sbp_miss"] = _slowest(_miss_timed(fn, [v[1] for v in fresh]))
            row["dtensor_miss"] = _slowest(_miss_timed(fn, [v[2] for v in fresh]))
            rows.append(row)
            del fresh
    return rows


def _med(stat) -> float:
    return stat["median_us"]


def _geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def report(rows: list[dict]) -> str:
    parts = [
        "Time per op call in µs: median (first–third quartile) of the slowest rank. See the docstring of",
        "`benchmarks/suites/dispatch.py` for the method. Layouts are given per input in the order of the op's",
        "arguments, one entry per placement axis (`S0` = `split(0)` / `Shard(0)`, `B` = `broadcast` / `Replicate`).",
        "`comm` is the number of collectives one call issued (sbp_torch / DTensor): 0 means the op ran on the",
        "local parts. Ratios are sbp_torch over DTensor; the targets are hit ≤ 0.75x and miss ≤ 0.1x.",
        "",
    ]
    for mesh in dict.fromkeys(r["mesh"] for r in rows):
        mine = [r for r in rows if r["mesh"] == mesh]
        table = []
        for r in mine:
            table.append(
                [
                    r["op"],
                    f"`{r['layout']}`",
                    f"{r['comm_sbp']} / {r['comm_dtensor']}",
                    harness.fmt(r["floor"]),
                    harness.fmt(r["sbp_hit"]),
                    harness.fmt(r["dtensor_hit"]),
                    harness.ratio(r["sbp_hit"], r["dtensor_hit"]),
                    harness.fmt(r.get("sbp_hit_grad")),
                    harness.fmt(r.get("dtensor_hit_grad")),
                    harness.ratio(r.get("sbp_hit_grad"), r.get("dtensor_hit_grad")),
                    harness.fmt(r["sbp_miss"], "ms"),
                    harness.fmt(r["dtensor_miss"], "ms"),
                    harness.ratio(r["sbp_miss"], r["dtensor_miss"]),
                ]
            )
        hit = [_med(r["sbp_hit"]) / _med(r["dtensor_hit"]) for r in mine]
        grad = [_med(r["sbp_hit_grad"]) / _med(r["dtensor_hit_grad"]) for r in mine if "sbp_hit_grad" in r]
        miss = [_med(r["sbp_miss"]) / _med(r["dtensor_miss"]) for r in mine]
        parts += [
            f"## Placement {mesh}",
            "",
            harness.markdown_table(
                [
                    "op",
                    "layout",
                    "comm",
                    "floor (local op)",
                    "sbp_torch hit",
                    "DTensor hit",
                    "hit ratio",
                    "sbp_torch hit, grad",
                    "DTensor hit, grad",
                    "ratio, grad",
                    "sbp_torch miss",
                    "DTensor miss",
                    "miss ratio",
                ],
                table,
            ),
            "",
            f"Hit ratio: geometric mean {_geomean(hit):.2f}x, {sum(h <= 0.75 for h in hit)} of {len(hit)} ops "
            f"within the 0.75x target; with inputs that require grad, geometric mean {_geomean(grad):.2f}x, "
            f"{sum(h <= 0.75 for h in grad)} of {len(grad)}. Miss ratio: geometric mean {_geomean(miss):.2f}x, "
            f"{sum(m <= 0.1 for m in miss)} of {len(miss)} within 0.1x. Dispatch overhead above the floor on a "
            f"hit (median of ops): sbp_torch {_median_overhead(mine, 'sbp_hit'):.1f} µs, "
            f"DTensor {_median_overhead(mine, 'dtensor_hit'):.1f} µs.",
            "",
        ]
    return "\n".join(parts)


def _median_overhead(rows: list[dict], key: str) -> float:
    values = sorted(_med(r[key]) - _med(r["floor"]) for r in rows)
    return values[len(values) // 2] if values else float("nan")


def plot(rows: list[dict], path: str) -> None:
    """One panel per placement: per op, the floor, hits and misses of both libraries (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meshes = list(dict.fromkeys(r["mesh"] for r in rows))
    series = [
        ("floor", "floor (local op)", "#999999"),
        ("sbp_hit", "sbp_torch hit", "#1f77b4"),
        ("dtensor_hit", "DTensor hit", "#ff7f0e"),
        ("sbp_miss", "sbp_torch miss", "#aec7e8"),
        ("dtensor_miss", "DTensor miss", "#ffbb78"),
    ]
    fig, axes = plt.subplots(len(meshes), 1, figsize=(12, 3.6 * len(meshes)), squeeze=False)
    for ax, mesh in zip(axes[:, 0], meshes):
        mine = [r for r in rows if r["mesh"] == mesh]
        width = 0.8 / len(series)
        for j, (key, label, color) in enumerate(series):
            xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(mine))]
            meds = [_med(r[key]) for r in mine]
            lo = [m - r[key]["q1_us"] for m, r in zip(meds, mine)]
            hi = [r[key]["q3_us"] - m for m, r in zip(meds, mine)]
            ax.bar(xs, meds, width, yerr=[lo, hi], label=label, color=color, capsize=1.5)
        ax.set_xticks(range(len(mine)), [r["op"] for r in mine], rotation=20)
        ax.set_yscale("log")
        ax.set_ylabel("µs per call")
        ax.set_title(f"placement {mesh}")
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].legend(ncol=len(series), fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
