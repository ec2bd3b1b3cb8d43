"""Planning: the planner's layout beside the hand-written ones (DP, TP, 2-D, sharded DP) on 4 ranks, each
predicted and measured, for the GPT example and three zoo models; the uneven-batch GPT-NeoX case; a memory limit.

The cost model is ``planner.calibrate()``'s, measured at the start of the launch on these 4 ranks. For each model
the same initial weights train on the same batches (8 rows: even over 4 and over 2) in every variant:

* the hand layouts, each priced by ``planner.predict`` (the whole step traced as it will run);
* ``planned``: ``planner.plan(model, batch, 4, costs=calibrated)``, applied by ``model.to_global(plan)``, the
  batch laid out by ``plan.layout``;
* ``measured 1`` to ``measured 3``: three fresh plans with ``measure=5`` (every mesh and storage of 4 ranks timed
  for a few steps inside the planner, the fastest measured taken), each then timed as the other variants are.

A step is forward, ``zero_grad``, backward, AdamW ``step()`` and the loss as a number; times are the slowest
rank's, median and quartiles over the timed steps after warm-up. The planned variant's losses are compared with
one process's on the same batches (largest relative difference). **Order**: the hand layouts sorted by predicted
step time against sorted by measured step time. **Uneven batch**: collectives one step issues (``st.explain``) for
GPT-NeoX with 8 rows laid out as data parallel, 6 rows the same way, and 6 rows laid out by the planner.
**Memory**: the GPT example planned under a per-rank limit of 60% of what the replicated layout needs; the peak
is what the profiler saw the rank hold during the second step (as in the sharded suite), beside the prediction.
"""

from __future__ import annotations

import copy
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

import sbp_torch as st
from benchmarks import harness
from sbp_torch import planner
from sbp_torch.sbp import broadcast, split
from zoo import dense

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
)
import gpt  # noqa: E402

TITLE = "Planning: planned layouts beside hand-written ones, predicted and measured"
WORLDS = [4]
ROWS = 8
STEPS, QUICK_STEPS = (2, 8), (1, 3)  # (warm-up, timed)
ZOO = ("gpt_neox", "qwen2", "bert")
MEASURED_PLANS, MEASURE = 3, 5  # fresh plans per model with plan(measure=MEASURE): every candidate on 4 ranks


class _Case:
    def __init__(self, name, make, batches, tp_plan):
        self.name, self.make, self.batches, self.tp_plan = name, make, batches, tp_plan


def _gpt_batches(n, rows=ROWS):
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        tokens = torch.randint(gpt.VOCAB, (rows, gpt.CONTEXT + 1), generator=gen)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _cases() -> list[_Case]:
    def gpt_model():
        torch.manual_seed(0)
        return gpt.GPT()

    cases = [
        _Case("GPT example", gpt_model, _gpt_batches, lambda wrap: {k: wrap(v) for k, v in gpt.TENSOR_PARALLEL.items()})
    ]
    for zoo in dense.ZOO:
        if zoo.name in ZOO:
            cases.append(
                _Case(
                    zoo.name,
                    lambda zoo=zoo: dense.make(zoo),
                    lambda n, rows=ROWS, zoo=zoo: dense.batches(zoo, n, rows=rows),
                    lambda wrap, zoo=zoo: zoo.tp_plan(wrap),
                )
            )
    return cases


def _call(model, batch):
    out = model(**batch) if isinstance(batch, dict) else model(*batch)
    return out if isinstance(out, torch.Tensor) else out.loss


def _hand_layouts(case: _Case) -> dict:
    """Name -> (placement, sbp plan, batch sbp, shard axis, predict's axes)."""
    line, grid = st.placement("cpu", [0, 1, 2, 3]), st.placement("cpu", [[0, 1], [2, 3]])
    return {
        "DP": (line, broadcast, (split(0),), None, (0, None)),
        "TP": (line, case.tp_plan(lambda s: (s,)), (broadcast,), None, (None, 0)),
        "2-D": (grid, case.tp_plan(lambda s: (broadcast, s)), (split(0), broadcast), None, (0, 1)),
        "sharded DP": (line, broadcast, (split(0),), 0, (0, None)),
    }


def _trainer(model, lay_out):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch):
        loss = _call(model, lay_out(batch))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def _lay_out_batch(placement, sbp):
    def one(t):
        return (
            t.to_global(placement, (broadcast,) * placement.ndim).to_global(sbp=sbp)
            if isinstance(t, torch.Tensor)
            else t
        )

    return lambda batch: (
        {k: one(v) for k, v in batch.items()} if isinstance(batch, dict) else tuple(one(v) for v in batch)
    )


def _timed_steps(step, batches, warmup, timed) -> tuple[dict, list[float]]:
    """The harness's timing of ``step`` over ``batches``, one per call; and every call's loss."""
    losses, upcoming = [], iter(batches)
    stats = harness.timed(lambda: losses.append(step(next(upcoming))), repeats=timed, warmup=warmup)
    return stats, losses


def _reference_losses(case: _Case, batches) -> list[float]:
    model = case.make()
    step = _trainer(model, lambda b: b)
    return [step(b) for b in batches]


def _uneven_rows(costs) -> list[dict]:
    zoo = next(z for z in dense.ZOO if z.name == "gpt_neox")
    rows = []
    line = st.placement("cpu", [0, 1, 2, 3])
    for label, n_rows, planned in (("DP, 8 rows", 8, False), ("DP, 6 rows", 6, False), ("planned, 6 rows", 6, True)):
        batch = dense.batches(zoo, 1, rows=n_rows)[0]
        model = dense.make(zoo)
        if planned:
            plan = planner.plan(model, batch, 4, costs=costs)
            model.to_global(plan)
            lay = plan.layout
            chosen = plan.label
        else:
            model.to_global(line, broadcast)
            lay, chosen = _lay_out_batch(line, (split(0),)), "data 4"
        found = st.explain(lambda b: _call(model, lay(b)), batch)
        rows.append(
            {"kind": "uneven", "case": label, "layout": chosen, "collectives": len(found), "counts": found.counts()}
        )
    return rows


def _memory_rows(costs, quick) -> list[dict]:
    case = _cases()[0]
    batches = case.batches(3)
    model = case.make()
    free = planner.plan(model, batches[0], 4, costs=costs)
    limit = 0.6 * free.predicted.memory_bytes
    plan = planner.plan(model, batches[0], 4, costs=costs, memory_per_rank=limit)
    model.to_global(plan)
    step = _trainer(model, plan.layout)
    losses = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for i, batch in enumerate(batches[:2]):
            with record_function(harness.MEASURED if i == 1 else "step"):
                losses.append(step(batch))
    peak = torch.tensor([float(harness.peak_memory(prof)["peak"])], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    want = _reference_losses(case, batches[:2])
    return [
        {
            "kind": "memory",
            "case": case.name,
            "limit": limit,
            "replicated_predicted": free.predicted.memory_bytes,
            "layout": plan.label,
            "predicted": plan.predicted.memory_bytes,
            "measured_peak": peak.item(),
            "loss_diff": harness.relative_difference(losses, want),
        }
    ]


def measure(world: int, quick: bool) -> list[dict]:
    warmup, timed = QUICK_STEPS if quick else STEPS
    started = time.perf_counter()
    costs = planner.calibrate()
    rows = [{"kind": "costs", "name": costs.name, "json": costs.to_json(), "seconds": time.perf_counter() - started}]
    for case in _cases()[: 2 if quick else None]:
        batches = case.batches(warmup + timed)
        want = _reference_losses(case, batches)
        reference = case.make()
        for name, (placement, sbp, batch_sbp, shard, axes) in _hand_layouts(case).items():
            predicted = planner.predict(
                reference,
                batches[0],
                placement,
                sbp,
                data_axis=axes[0],
                tensor_axis=axes[1],
                shard=shard is not None,
                costs=costs,
            )
            model = copy.deepcopy(reference).to_global(placement, sbp, shard=shard)
            stats, losses = _timed_steps(_trainer(model, _lay_out_batch(placement, batch_sbp)), batches, warmup, timed)
            rows.append(
                {
                    "kind": "step",
                    "model": case.name,
                    "variant": name,
                    "layout": name,
                    **stats,
                    "predicted_s": predicted.step_s,
                    "loss_diff": harness.relative_difference(losses, want),
                }
            )
        for variant, measure in [("planned", 0)] + [(f"measured {i + 1}", MEASURE) for i in range(MEASURED_PLANS)]:
            started = time.perf_counter()
            plan = planner.plan(reference, batches[0], 4, costs=costs, measure=measure)
            seconds = time.perf_counter() - started
            model = copy.deepcopy(reference).to_global(plan)
            stats, losses = _timed_steps(_trainer(model, plan.layout), batches, warmup, timed)
            rows.append(
                {
                    "kind": "step",
                    "model": case.name,
                    "variant": variant,
                    "layout": plan.label,
                    **stats,
                    "predicted_s": plan.predicted.step_s,
                    "loss_diff": harness.relative_difference(losses, want),
                    "plan_seconds": seconds,
                    "decisions": plan.decisions,
                }
            )
            if dist.get_rank() == 0:
                print(f"{case.name}: {variant} {plan.label}, {stats['median_us'] / 1e3:.1f} ms", flush=True)
    rows += _uneven_rows(costs)
    rows += _memory_rows(costs, quick)
    return rows


def _order(rows, key) -> list[str]:
    return [r["variant"] for r in sorted(rows, key=key)]


def report(rows: list[dict]) -> str:
    costs = next(r for r in rows if r["kind"] == "costs")
    out = [f"Cost model: calibrated on these ranks in {costs['seconds']:.1f} s: `{costs['json']}`", ""]
    steps = [r for r in rows if r["kind"] == "step"]
    table, summary = [], []
    for model in dict.fromkeys(r["model"] for r in steps):
        mine = [r for r in steps if r["model"] == model]
        hand = [r for r in mine if r["variant"] != "planned" and not r["variant"].startswith("measured")]
        planned = next(r for r in mine if r["variant"] == "planned")
        measured = [r for r in mine if r["variant"].startswith("measured")]
        best = min(hand, key=lambda r: r["median_us"])
        for r in mine:
            error = (r["predicted_s"] * 1e6 - r["median_us"]) / r["median_us"]
            table.append(
                [
                    model,
                    r["variant"],
                    r["layout"],
                    harness.fmt(r, "ms"),
                    f"{r['predicted_s'] * 1e3:.1f} ms",
                    f"{error:+.0%}",
                    f"{r['loss_diff']:.1e}",
                ]
            )
        predicted_order = _order(hand, lambda r: r["predicted_s"])
        measured_order = _order(hand, lambda r: r["median_us"])
        summary.append(
            [
                model,
                planned["layout"],
                f"{planned['median_us'] / best['median_us']:.2f}x ({best['variant']})",
                ", ".join(f"{r['layout']} {r['median_us'] / best['median_us']:.2f}x" for r in measured),
                " < ".join(predicted_order),
                " < ".join(measured_order),
                "yes" if predicted_order == measured_order else "no",
                f"{planned.get('plan_seconds', 0):.1f} s",
            ]
        )
    out += [
        "### Quality",
        "",
        harness.markdown_table(
            [
                "model",
                "planned",
                "planned vs best hand layout",
                f"measure={MEASURE}: {MEASURED_PLANS} fresh plans vs the best hand layout",
                "predicted order",
                "measured order",
                "same",
                "planning",
            ],
            summary,
        ),
        "",
    ]
    out += [
        "### Every layout, predicted and measured",
        "",
        harness.markdown_table(
            ["model", "variant", "layout", "measured step", "predicted", "error", "loss vs one process"], table
        ),
        "",
    ]
    uneven = [r for r in rows if r["kind"] == "uneven"]
    out += [
        "### GPT-NeoX with an uneven batch",
        "",
        harness.markdown_table(
            ["batch", "layout", "collectives per step", "kinds"],
            [
                [r["case"], r["layout"], r["collectives"], ", ".join(f"{k} {v}" for k, v in r["counts"].items())]
                for r in uneven
            ],
        ),
        "",
    ]
    memory = [r for r in rows if r["kind"] == "memory"]
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    out += [
        "### A memory limit",
        "",
        harness.markdown_table(
            [
                "model",
                "limit",
                "replicated (predicted)",
                "planned",
                "predicted",
                "measured peak",
                "loss vs one process",
            ],
            [
                [
                    r["case"],
                    mib(r["limit"]),
                    mib(r["replicated_predicted"]),
                    r["layout"],
                    mib(r["predicted"]),
                    mib(r["measured_peak"]),
                    f"{r['loss_diff']:.1e}",
                ]
                for r in memory
            ],
        ),
    ]
    return "\n".join(out)
