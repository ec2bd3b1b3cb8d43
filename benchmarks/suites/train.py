"""Training steps per second of the GPT example: sbp_torch and DTensor on 4 ranks, beside one process.

The model, batches, optimizer (AdamW) and step are those of ``examples/gpt.py``; each library trains a
copy of the same initial model on the same batches for the warm-up and timed steps, and its losses are
compared with single-process training step by step (largest relative difference recorded), so a fast but
wrong path cannot produce a good number. A step is: lay out the batch, forward, ``zero_grad``, backward
(with the gradient reduction), ``optimizer.step()`` and reading the loss as a Python number. Times are the
slowest rank's, median and quartiles, after warm-up (first-step caches and optimizer state excluded).

sbp_torch runs the example's plans (``gpt.plans``); the batch is laid out as rank 0's batch broadcast and
then split (``to_global(placement, B, check_meta=False).to_global(sbp=...)``).

DTensor gets the closest faithful setup of each plan, on the same process group:

* ``dp``: ``distribute_module`` on a 1-D mesh of 4 (every parameter and buffer ``Replicate``, the tied
  embedding re-tied), the batch ``distribute_tensor(batch, mesh, [Shard(0)])`` so that the whole model
  runs on DTensors; the ``Partial`` gradients are all-reduced after backward in one flat buffer (as DDP and
  sbp_torch's ``Module.to_global`` bucket them; DTensor itself has no bucketing, and redistributing each
  gradient would add one collective per parameter).
* ``tp``: ``parallelize_module`` on the 1-D mesh with Megatron-style styles on the example's modules:
  ``ColwiseParallel`` for q/k/v (DTensor outputs, so that the model's ``view`` to heads works unchanged)
  and the first MLP linear, ``RowwiseParallel`` for the attention output and second MLP linear,
  ``RowwiseParallel`` on the embedding (vocabulary-parallel) and ``ColwiseParallel`` on the LM head with
  vocabulary-split logits, re-tied to the embedding, into ``loss_parallel()`` cross entropy. The causal
  mask buffers become ``Replicate`` DTensors (a plain tensor cannot be mixed with DTensors); layer norms
  and the position embedding stay plain, replicated tensors (the example's plan has no sequence
  parallelism). The batch: ``distribute_tensor(batch, mesh, [Replicate()])`` (rank 0's, like sbp_torch's).
* ``dp_tp``: a 2x2 ``init_device_mesh(("dp", "tp"))`` over ranks [[0, 1], [2, 3]], as sbp_torch's
  placement: the ``tp`` plan on ``mesh["tp"]`` (``parallelize_module`` takes 1-D meshes), each ``dp`` row
  its half of the batch (``distribute_tensor(batch, mesh, [Shard(0), Replicate()]).to_local()``), and after
  backward the gradients' local parts (and the loss, for logging) averaged over ``dp`` in one all-reduce.

sbp_torch and DTensor take turns within each mode (one step each per round), so that a shared machine's
changing load falls on both alike. ``plain`` is the example's model trained by one process (its own one-rank
launch), the baseline the parallel modes are measured against; the 4-rank launch recomputes its losses in
every rank for the loss check. It runs one thread, like each of the 4 ranks: the model is far too small to
gain from intra-op threads, and with two threads on a busy 2-core machine its step time swung tenfold. The 4
ranks share this machine's cores, so on a small machine parallel steps/s measure overhead, not speed-up.

Target (the issue): ``dp_tp`` sbp_torch ≥ 1.2x DTensor's steps/s, with equal losses.
"""

from __future__ import annotations

import collections
import copy
import os
import statistics

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from benchmarks import harness
from sbp_torch.sbp import broadcast
from zoo.gpt import load_example

TITLE = "Training steps: the GPT example with sbp_torch, DTensor and one process"
WORLDS = [1, 4]
MODES = ["dp", "tp", "dp_tp"]
TARGET = 1.2  # sbp_torch / DTensor steps per second in dp_tp
LOSS_TOLERANCE = 1e-5  # the example's own check


def dtensor_tp_plan() -> dict:
    """The example's tensor-parallel plan as DTensor parallel styles on the same modules (fresh objects:
    ``parallelize_module`` writes into them)."""
    return {
        "tokens": RowwiseParallel(input_layouts=Replicate()),  # vocabulary-parallel embedding
        "blocks.*.attn.[qkv]": ColwiseParallel(use_local_output=False),  # heads split
        "blocks.*.attn.out": RowwiseParallel(),
        "blocks.*.mlp.0": ColwiseParallel(),
        "blocks.*.mlp.2": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),  # vocabulary-split logits
    }


def _timed_training(steps: dict, batches, warmup: int, repeats: int) -> dict[str, tuple[dict, list[float]]]:
    """Times each ``step(idx, targets) -> loss`` over ``batches`` (one per call), the steps taking turns;
    returns name -> (statistics, losses)."""
    losses = {name: [] for name in steps}

    def one_step(name, step, batches):
        return lambda: losses[name].append(step(*next(batches)))

    calls = {name: one_step(name, step, iter(batches)) for name, step in steps.items()}
    stats = harness.timed_interleaved(calls, repeats, warmup)
    return {name: (stats[name], losses[name]) for name in steps}


def _collectives_per_step(step, batch) -> dict[str, int]:
    """Process-group calls of one ``step`` by kind, from torch.profiler's ``c10d::`` events (the ops both
    libraries' collectives go through). Where the time of a latency-bound step goes."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(*batch)
    kinds = collections.Counter(
        e.name[len("c10d::") :].strip("_").replace("_base", "").replace("_", "-")
        for e in prof.events()
        if e.name.startswith("c10d::")
    )
    return dict(kinds.most_common())


def sbp_torch_layout(gpt, model, mode: str):
    """(The optimizer of ``model`` laid out for ``mode``, in place; the function that lays out a batch.)"""
    placement, plan, batch_sbp = gpt.plans(dist.get_world_size())[mode]
    model.to_global(placement, plan)
    replicated = (broadcast,) * placement.ndim

    def layout(t):
        return t.to_global(placement, replicated, check_meta=False).to_global(sbp=batch_sbp)

    return gpt.make_optimizer(model), layout


def sbp_torch_step(gpt, model, mode: str):
    optimizer, layout = sbp_torch_layout(gpt, model, mode)
    return lambda idx, targets: gpt.train_step(model, optimizer, idx, targets, layout)


def _bucketed_all_reduce(
    params, extra: torch.Tensor | None, group, scale: float, completes_partial: bool
) -> torch.Tensor | None:
    """All-reduce the gradients' local parts (and ``extra``) in one flat buffer, times ``scale``.

    ``completes_partial``: the group is the whole mesh, so ``Partial`` gradients become ``Replicate``.
    """
    grads = [p.grad for p in params]
    locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    pieces = [t.reshape(-1) for t in locals_] + ([extra.reshape(-1)] if extra is not None else [])
    flat = torch.cat(pieces)
    dist.all_reduce(flat, group=group)
    flat.mul_(scale)
    parts = flat.split([t.numel() for t in pieces])
    for p, g, local, part in zip(params, grads, locals_, parts):
        part = part.view(local.shape)
        if isinstance(g, DTensor):  # same layout, reduced values
            placements = [Replicate() if completes_partial and pl.is_partial() else pl for pl in g.placements]
            p.grad = DTensor.from_local(
                part, g.device_mesh, placements, run_check=False, shape=g.shape, stride=g.stride()
            )
        else:
            p.grad = part
    return parts[-1] if extra is not None else None


def _retie(model) -> None:
    """Distributing replaces each module's parameters separately: tie the LM head to the embedding again."""
    model.head.weight = model.tokens.weight


def _dtensor_dp_step(gpt, model):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    distribute_module(model, mesh)
    _retie(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = gpt.make_optimizer(model)

    def step(idx, targets):
        idx, targets = (distribute_tensor(t, mesh, [Shard(0)]) for t in (idx, targets))
        loss = model(idx, targets)
        optimizer.zero_grad()
        loss.backward()
        partial = [p for p in params if p.grad.placements[0].is_partial()]  # a Replicate one is complete
        assert all(p.grad.placements[0].reduce_op == "sum" for p in partial)
        _bucketed_all_reduce(partial, None, mesh.get_group(), 1.0, completes_partial=True)
        optimizer.step()
        return loss.full_tensor().item()

    return step


def _dtensor_tp_model(model, tp_mesh):
    parallelize_module(model, tp_mesh, dtensor_tp_plan())
    _retie(model)
    for block in model.blocks:
        block.attn.future = distribute_tensor(block.attn.future, tp_mesh, [Replicate()])
    return model


def _dtensor_tp_step(gpt, model):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    _dtensor_tp_model(model, mesh)
    optimizer = gpt.make_optimizer(model)

    def step(idx, targets):
        idx, targets = (distribute_tensor(t, mesh, [Replicate()]) for t in (idx, targets))
        with loss_parallel():
            loss = model(idx, targets)
            optimizer.zero_grad()
            loss.backward()
        optimizer.step()
        return loss.full_tensor().item()

    return step


def _dtensor_dp_tp_step(gpt, model):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    _dtensor_tp_model(model, mesh["tp"])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = gpt.make_optimizer(model)
    dp_group, dp_size = mesh.get_group("dp"), mesh["dp"].size()

    def step(idx, targets):
        idx, targets = (distribute_tensor(t, mesh, [Shard(0), Replicate()]).to_local() for t in (idx, targets))
        with loss_parallel():
            loss = model(idx, targets)
            optimizer.zero_grad()
            loss.backward()
        mean = _bucketed_all_reduce(params, loss.to_local().detach(), dp_group, 1.0 / dp_size, completes_partial=False)
        optimizer.step()
        return mean.item()

    return step


DTENSOR_STEPS = {"dp": _dtensor_dp_step, "tp": _dtensor_tp_step, "dp_tp": _dtensor_dp_tp_step}


def measure(world: int, quick: bool) -> list[dict]:
    code = harness.code_state()  # at the start: the code this process imported
    gpt = load_example()
    warmup, repeats = (3, 10) if quick else (5, 40)
    *batches, last = gpt.batches(warmup + repeats + 1)  # the last: one more step, profiled, not timed
    torch.manual_seed(0)
    initial = gpt.GPT()

    def plain_step():
        model = copy.deepcopy(initial)
        optimizer = gpt.make_optimizer(model)
        return lambda idx, targets: gpt.train_step(model, optimizer, idx, targets)

    if world == 1:
        torch.set_num_threads(1)  # see the module docstring
        stats, losses = _timed_training({"plain": plain_step()}, batches, warmup, repeats)["plain"]
        return [
            {
                "world": 1,
                "library": "plain",
                "mode": "one process",
                "step": stats,
                "losses": losses,
                "threads": torch.get_num_threads(),
                "code": code,
                "load": os.getloadavg()[0],
            }
        ]
    step = plain_step()
    want = [step(*batch) for batch in batches]
    rows = []
    for mode in MODES:
        steps = {
            "sbp_torch": sbp_torch_step(gpt, copy.deepcopy(initial), mode),
            "dtensor": DTENSOR_STEPS[mode](gpt, copy.deepcopy(initial)),
        }
        for library, (stats, losses) in _timed_training(steps, batches, warmup, repeats).items():
            rows.append(
                {
                    "world": world,
                    "library": library,
                    "mode": mode,
                    "step": stats,
                    "losses": losses,
                    "max_rel_diff": harness.relative_difference(losses, want),
                    "threads": torch.get_num_threads(),
                    "collectives": _collectives_per_step(steps[library], last),
                    "code": code,
                    "load": os.getloadavg()[0],
                }
            )
            if dist.get_rank() == 0:
                print(
                    f"  {mode:6} {library:9} {1e6 / stats['median_us']:7.2f} steps/s, losses differ from one "
                    f"process by {rows[-1]['max_rel_diff']:.1e}; collectives {rows[-1]['collectives']}",
                    flush=True,
                )
    return rows


def _fmt_collectives(kinds: dict[str, int]) -> str:
    return f"{sum(kinds.values())}: " + ", ".join(f"{n} {kind}" for kind, n in kinds.items())


def report(rows: list[dict]) -> str:
    by = {(r["library"], r["mode"]): r for r in rows}
    plain = by.get(("plain", "one process"))
    header = [
        "mode",
        "sbp_torch steps/s",
        "DTensor steps/s",
        "sbp_torch / DTensor",
        "collectives per step sbp_torch, DTensor",
        "loss rel. diff sbp_torch, DTensor",
    ]
    table, calls, verdict = [], [], ""
    for mode in MODES:
        sbp, dt = by.get(("sbp_torch", mode)), by.get(("dtensor", mode))
        if not sbp or not dt:
            continue
        speedup = dt["step"]["median_us"] / sbp["step"]["median_us"]
        table.append(
            [
                harness.LAYOUT_NAMES[mode],
                harness.fmt_rate(sbp["step"]),
                harness.fmt_rate(dt["step"]),
                f"{speedup:.2f}x",
                f"{sum(sbp['collectives'].values())}, {sum(dt['collectives'].values())}",
                f"{sbp['max_rel_diff']:.1e}, {dt['max_rel_diff']:.1e}",
            ]
        )
        calls += [
            [harness.LAYOUT_NAMES[mode], name, _fmt_collectives(r["collectives"])]
            for name, r in (("sbp_torch", sbp), ("DTensor", dt))
        ]
        if mode == "dp_tp":
            equal = max(sbp["max_rel_diff"], dt["max_rel_diff"]) < LOSS_TOLERANCE
            met = speedup >= TARGET and equal
            verdict = (
                f"**Target** (DP x TP: sbp_torch ≥ {TARGET}x DTensor's steps/s, equal losses): "
                f"{speedup:.2f}x, losses {'equal' if equal else 'DIFFERENT'} (within "
                f"{LOSS_TOLERANCE:.0e}): {'met' if met else 'missed'}."
            )
    lines = [
        "Steps per second of one training step of `examples/gpt.py` (forward, backward, AdamW), median "
        "(quartiles) over the timed steps, each the slowest rank's. Written by `benchmarks/suites/train.py`; "
        "its docstring gives the DTensor setup of each mode.",
        "",
        harness.markdown_table(header, table),
        "",
    ]
    four = [r for r in rows if r["world"] == 4]
    if plain:
        steps = len(plain["losses"])
        lines += [
            f"One process (plain PyTorch, {harness.threads(plain['threads'])}): "
            f"{harness.fmt_rate(plain['step'])} steps/s, "
            f"{harness.fmt(plain['step'], 'ms')} per step; its {steps} losses go from "
            f"{plain['losses'][0]:.4f} to {plain['losses'][-1]:.4f}.",
            "",
        ]
    if four:
        steps = len(four[0]["losses"])
        text = (
            f"Loss differences: largest relative difference from single-process training (recomputed in "
            f"each rank of the 4-rank launch) over all {steps} steps, warm-up included; tolerance "
            f"{LOSS_TOLERANCE:.0e}."
        )
        if plain:  # the one-process launch trained the same way, on its own thread count
            worst = max(harness.relative_difference(r["losses"], plain["losses"]) for r in four)
            text += f" Against the one-process launch's own losses the largest is {worst:.1e}."
        lines += [text, ""]
    if verdict:
        lines += [verdict, ""]
    if calls:
        lines += [
            "Process-group calls in one step (rank 0, counted by torch.profiler):",
            "",
            harness.markdown_table(["mode", "library", "calls"], calls),
            "",
        ]
    threads = statistics.mode(r["threads"] for r in four) if four else "?"
    lines += [
        f"The 4 ranks use {harness.threads(threads)} each. Code measured: {rows[0]['code'] if rows else '?'}. "
        f"{harness.load_note(rows)}"
    ]
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r["library"], r["mode"]): r for r in rows}
    modes = [m for m in MODES if ("sbp_torch", m) in by]
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (library, label) in enumerate((("sbp_torch", "sbp_torch"), ("dtensor", "DTensor"))):
        rates = [harness.steps_per_second(by[(library, m)]["step"]) for m in modes]
        xs = [j + (i - 0.5) * 0.38 for j in range(len(modes))]
        bars = ax.bar(
            xs,
            [r[0] for r in rates],
            0.38,
            label=label,
            yerr=[[r[0] - r[1] for r in rates], [r[2] - r[0] for r in rates]],
            capsize=3,
        )
        ax.bar_label(bars, [f"{r[0]:.1f}" for r in rates], padding=2, fontsize=8)
    plain = by.get(("plain", "one process"))
    if plain:
        ax.axhline(
            harness.steps_per_second(plain["step"])[0],
            color="gray",
            linestyle="--",
            label=f"one process ({harness.steps_per_second(plain['step'])[0]:.0f})",
        )
    ax.set_xticks(range(len(modes)), [harness.LAYOUT_NAMES[m] for m in modes])
    ax.set_yscale("log")  # one process is far above the 4 ranks that share its cores
    ax.set_ylim(top=ax.get_ylim()[1] * 10)  # room for the legend above everything
    ax.set_ylabel("training steps per second (median, quartiles)")
    ax.set_title("GPT example on 4 CPU ranks")
    ax.legend(loc="upper center", ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
