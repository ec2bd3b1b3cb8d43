"""How long planning takes at scale: unmodified ``transformers`` GPT-2 models built on the meta device, planned for
simulated worlds in one process (torch's fake process group), with the H100 node constants.

    .venv/bin/python -m benchmarks.plan_at_scale [--quick]

* GPT-2-medium-shaped (24 layers, hidden 1024, 16 heads, sequence 1024, batch 64) on 64 ranks, every mesh;
* GPT-3-175B-shaped (96 layers, hidden 12288, 96 heads, sequence 2048, bf16, batch 1536) on 1024 ranks, every
  mesh, with 80 GB per rank and again without a limit; then on the mesh of Megatron-LM's published layout without
  its pipeline (data 128 x tensor 8: the planner has no pipeline stages), with 80 GB.

Writes ``docs/benchmarks/plan_at_scale.md``: the search time, what was chosen, the best layouts tried. Each plan is
made once, in a fresh process (``--quick``: the first case only)."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import sbp_torch as st
from benchmarks import harness
from sbp_torch import planner

CASES = {
    "GPT-2-medium / 64 ranks": dict(layers=24, width=1024, heads=16, seq=1024, rows=64, world=64, dtype=None),
    "GPT-3-175B / 1024 ranks": dict(layers=96, width=12288, heads=96, seq=2048, rows=1536, world=1024, dtype="bf16"),
    "GPT-3-175B / data 128 x tensor 8": dict(
        layers=96, width=12288, heads=96, seq=2048, rows=1536, world=1024, dtype="bf16", mesh=(128, 8)
    ),
}


def _model(layers, width, heads, seq, dtype):
    import transformers as tf

    config = tf.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=seq, vocab_size=50257)
    with torch.device("meta"):
        model = tf.GPT2LMHeadModel(config)
    return model.to(torch.bfloat16) if dtype == "bf16" else model


def _row(name, case, limit):
    model = _model(case["layers"], case["width"], case["heads"], case["seq"], case["dtype"])
    ids = torch.zeros(case["rows"], case["seq"], dtype=torch.long)
    world = case["world"]
    if "mesh" in case:
        world = st.placement("cpu", torch.arange(world).reshape(case["mesh"]).tolist())
    started = time.perf_counter()
    try:
        plan = planner.plan(model, {"input_ids": ids, "labels": ids}, world, costs=planner.H100, memory_per_rank=limit)
    except planner.PlanError as err:
        return {"case": name, "limit": limit, "seconds": time.perf_counter() - started, "error": str(err)}
    return {
        "case": name,
        "limit": limit,
        "seconds": time.perf_counter() - started,
        "chosen": plan.label + (" + recomputation" if plan.recompute else ""),
        "step_s": plan.predicted.step_s,
        "memory": plan.predicted.memory_bytes,
        "decisions": plan.decisions,
        "search": plan.search,
        "alternatives": plan.alternatives[:5],
    }


def report(rows) -> str:
    lines = [f"Machine: {harness.machine()}. Cost model: `planner.H100`.", ""]
    table = []
    for r in rows:
        limit = "none" if r["limit"] == float("inf") else f"{r['limit'] / 1e9:.0f} GB"
        if "error" in r:
            table.append([r["case"], limit, f"{r['seconds']:.1f} s", r["error"], "", ""])
            continue
        blocks = ", ".join(f"{k} {v}" for k, v in r["decisions"].get("transformer.h.*", {}).items())
        table.append(
            [
                r["case"],
                limit,
                f"{r['seconds']:.1f} s",
                r["chosen"],
                f"{r['step_s']:.3g} s, {r['memory'] / 1e9:.1f} GB",
                blocks,
            ]
        )
    lines.append(
        harness.markdown_table(
            ["model / world", "memory limit", "search", "chosen", "predicted step, memory", "each block"], table
        )
    )
    for r in rows:
        if "alternatives" in r:
            limit = "none" if r["limit"] == float("inf") else f"{r['limit'] / 1e9:.0f} GB"
            lines += ["", f"{r['case']}, memory limit {limit}: the best layouts tried", ""]
            lines.append(
                harness.markdown_table(
                    ["layout", "predicted step", "memory per rank"],
                    [
                        [
                            a["label"] + (" + recomputation" if a.get("recomputed") else ""),
                            f"{a['step_s']:.3g} s",
                            f"{a['memory_bytes'] / 1e9:.1f} GB",
                        ]
                        for a in r["alternatives"]
                    ],
                )
            )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rows = []
    for name, case in list(CASES.items())[: 1 if args.quick else None]:
        limits = [float("inf")] if case["world"] < 1024 else [80e9] if "mesh" in case else [80e9, float("inf")]
        for limit in limits:
            rows.append(_row(name, case, limit))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "alternatives"}, default=str), flush=True)
    with open(os.path.join(harness.DOCS, "plan_at_scale.json"), "w") as f:
        json.dump(rows, f, indent=1, default=str)
    with open(os.path.join(harness.DOCS, "plan_at_scale.md"), "w") as f:
        header = "# Planning at scale\n\n<!-- generated by `python -m benchmarks.plan_at_scale`; do not edit -->"
        f.write(f"{header}\n\n{report(rows)}\n")


if __name__ == "__main__":
    main()
