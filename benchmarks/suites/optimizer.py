"""One AdamW step over a transformer's parameters: plain tensors, data-parallel global tensors, DTensor.

A training step ends in ``optimizer.step()``, which with ``foreach=True`` updates every parameter with about
ten ``_foreach_*`` ops over the list of all parameters. For data-parallel (broadcast/replicated) parameters no
communication is needed, so whatever a distributed tensor library adds over plain tensors here is the
overhead of dispatching those ops on its tensors, which grows with the number of parameter tensors.

Each rank builds the GPT model of ``examples/gpt.py`` (3 blocks: 52 parameter tensors, the tied
embedding counted once; the full run adds 12 blocks, 196 tensors) and times ``AdamW(foreach=True).step()``
three ways, on the same values:

* ``plain``: the model's own tensors, one process's view (what every data-parallel rank runs under DDP);
* ``sbp_torch``: ``model.to_global(placement.all("cpu"), broadcast)``, gradients broadcast global tensors;
* ``DTensor``: every parameter ``distribute_tensor(p, mesh, [Replicate()])`` on a 1-D mesh, gradients
  ``Replicate`` DTensors.

Gradients are set before timing (the same random values for all three) and stay set, so every timed call
is a whole step, first-step state creation excluded by the warm-up. The three take turns, one step each per
round, so that a shared machine's changing load falls on all of them alike. After the timed steps the three sets of
parameters have taken the same steps and must agree; the largest difference is recorded with the times.
Target (the issue): the sbp_torch step at most 2x the plain step.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import sbp_torch as st
from benchmarks import harness
from sbp_torch.sbp import broadcast
from zoo.gpt import load_example

TITLE = "Optimizer step: AdamW over a transformer's parameters"
WORLDS = [2, 4]
LIBRARIES = ["plain", "sbp_torch", "dtensor"]
TARGET = 2.0  # sbp_torch step / plain step, for the ~50-tensor model
LAYERS = 3  # GPT blocks of the ~50-tensor model the target is about; the full run adds MORE_LAYERS
MORE_LAYERS = 12


def _adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=True)


def _case(gpt, layers: int, world: int, quick: bool, code: str) -> list[dict]:
    torch.manual_seed(0)
    model = gpt.GPT(layers)
    params = list(model.parameters())
    grads = [torch.randn_like(p) for p in params]

    plain = [p.detach().clone().requires_grad_() for p in params]
    for p, g in zip(plain, grads):
        p.grad = g.clone()

    placement = st.placement.all("cpu")
    global_model = copy.deepcopy(model).to_global(placement, broadcast)
    sbp_params = list(global_model.parameters())
    for p, g in zip(sbp_params, grads):
        p.grad = g.clone().to_global(placement, broadcast, check_meta=False)

    mesh = init_device_mesh("cpu", (world,))
    dt_params = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Replicate()])) for p in params]
    for p, g in zip(dt_params, grads):
        p.grad = DTensor.from_local(g.clone(), mesh, [Replicate()], run_check=False)

    repeats, warmup = (10, 3) if quick else (50, 5)
    row = {"world": world, "layers": layers, "tensors": len(params), "numel": sum(p.numel() for p in params)}
    steps = {name: _adamw(group).step for name, group in zip(LIBRARIES, (plain, sbp_params, dt_params))}
    row.update(harness.timed_interleaved(steps, repeats, warmup))
    with torch.no_grad():  # the same steps on the same values: the same parameters
        row["max_abs_diff_sbp_torch"] = max((a - b.to_local()).abs().max().item() for a, b in zip(plain, sbp_params))
        row["max_abs_diff_dtensor"] = max((a - b.to_local()).abs().max().item() for a, b in zip(plain, dt_params))
    row["code"], row["load"] = code, os.getloadavg()[0]  # the machine may be shared: say how busy
    return [row]


def measure(world: int, quick: bool) -> list[dict]:
    code = harness.code_state()  # at the start: the code this process imported
    gpt = load_example()
    rows = []
    for layers in [LAYERS] if quick else [LAYERS, MORE_LAYERS]:
        rows += _case(gpt, layers, world, quick, code)
        if dist.get_rank() == 0:
            r = rows[-1]
            print(
                f"  {r['tensors']} tensors: plain {r['plain']['median_us']:.0f} us, sbp_torch "
                f"{r['sbp_torch']['median_us']:.0f} us, DTensor {r['dtensor']['median_us']:.0f} us",
                flush=True,
            )
    return rows


def report(rows: list[dict]) -> str:
    header = [
        "ranks",
        "tensors",
        "plain",
        "sbp_torch",
        "sbp_torch / plain",
        "DTensor",
        "DTensor / plain",
        "max abs. difference sbp_torch, DTensor",
    ]
    table = [
        [
            r["world"],
            f"{r['tensors']} ({r['numel'] / 1e3:.0f}k values)",
            harness.fmt(r["plain"], "ms"),
            harness.fmt(r["sbp_torch"], "ms"),
            harness.ratio(r["sbp_torch"], r["plain"]),
            harness.fmt(r["dtensor"], "ms"),
            harness.ratio(r["dtensor"], r["plain"]),
            f"{r['max_abs_diff_sbp_torch']:.1e}, {r['max_abs_diff_dtensor']:.1e}",
        ]
        for r in rows
    ]
    verdicts = []
    for r in rows:
        if r["layers"] != LAYERS:
            continue
        times = r["sbp_torch"]["median_us"] / r["plain"]["median_us"]
        verdicts.append(
            f"- {r['world']} ranks: sbp_torch / plain = {times:.2f}x: target ≤ {TARGET:.0f}x "
            f"{'met' if times <= TARGET else 'missed'}."
        )
    return "\n".join(
        [
            "One `torch.optim.AdamW(foreach=True).step()` on every rank, median (quartiles) in ms of the slowest "
            "rank; gradients set beforehand. Written by `benchmarks/suites/optimizer.py` (its docstring says "
            "what is measured and why).",
            "",
            harness.markdown_table(header, table),
            "",
            "**Target** (sbp_torch data-parallel step ≤ 2x the plain step, ~50 tensors):",
            "",
            *verdicts,
            "",
            f"The last column is the largest difference of a parameter from the plain one after the same steps. "
            f"Code measured: {rows[0]['code'] if rows else '?'}. {harness.load_note(rows)}",
        ]
    )


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"plain": "plain", "sbp_torch": "sbp_torch (B)", "dtensor": "DTensor (Replicate)"}
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(LIBRARIES)
    for i, lib in enumerate(LIBRARIES):
        xs = [j + (i - 1) * width for j in range(len(rows))]
        med = [r[lib]["median_us"] / 1e3 for r in rows]
        err = [
            [(r[lib]["median_us"] - r[lib]["q1_us"]) / 1e3 for r in rows],
            [(r[lib]["q3_us"] - r[lib]["median_us"]) / 1e3 for r in rows],
        ]
        ax.bar(xs, med, width, yerr=err, capsize=3, label=labels[lib])
    ax.set_xticks(range(len(rows)), [f"{r['world']} ranks\n{r['tensors']} tensors" for r in rows])
    ax.set_ylabel("AdamW step (ms), median and quartiles")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("One AdamW(foreach=True) step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
