"""Compiled training steps: the GPT example under ``torch.compile`` (Inductor), sbp_torch and DTensor, beside
the same libraries eager and a hand-written per-rank program compiled, on 4 ranks.

The model, batches, optimizer and layouts are those of ``benchmarks/suites/train.py`` (its docstring gives
DTensor's setup of each mode). The floor is ``handwritten_gpt.py``: the same model and collectives written
by hand on plain tensors (Megatron style). Compiled means the model's forward and backward go through
``torch.compile(model.forward, backend="inductor", fullgraph=True, dynamic=False)`` (static shapes: the
versions of the model share ``GPT.forward``, and Dynamo would otherwise compile the second one with
symbolic sizes after seeing the first one's), and the optimizer step through
``torch.compile(optimizer.step, backend="inductor")``, for every compiled variant. DTensor's data-parallel
gradient reduction stays eager (after backward, as the train suite does it). Inductor's all-reduce and
reduce-scatter bucketing passes are on for every variant. Each step's loss is compared with
single-process training. The first step of a compiled variant includes its compilation: its time is reported
as the compile time (slowest rank). The variants of a mode take turns, one step each per round.

Targets (issue #29): the compiled step at least 1.2x compiled DTensor and at least 0.91x the compiled
hand-written program in steps/s.
"""

from __future__ import annotations

import copy
import functools
import os
import time

import torch
import torch._dynamo
import torch._functorch.config
import torch._inductor.config
import torch.distributed as dist

import sbp_torch as st
from benchmarks import harness
from benchmarks.suites import train
from benchmarks.suites.handwritten_gpt import handwritten_step
from zoo.gpt import load_example

TITLE = "Compiled training steps: the GPT example under torch.compile, sbp_torch and DTensor"
WORLDS = [4]
MODES = train.MODES
VARIANTS = [
    "sbp_torch eager",
    "sbp_torch compiled",
    "sbp_torch compile_step",
    "DTensor eager",
    "DTensor compiled",
    "hand-written compiled",
]
WHOLE = "sbp_torch compile_step"  # its first call runs eagerly, its second compiles: both are its "first step"


class _CompiledSteps:
    """The example module with ``make_optimizer`` giving optimizers whose ``step`` is compiled."""

    def __init__(self, gpt):
        self._gpt = gpt

    def __getattr__(self, name):
        return getattr(self._gpt, name)

    def make_optimizer(self, model):
        optimizer = self._gpt.make_optimizer(model)
        optimizer.step = torch.compile(optimizer.step, backend="inductor")
        return optimizer


def _compiled(build, gpt, model, *args):
    """The step of ``build`` with the model's forward and backward and the optimizer step compiled (the model's
    ``forward`` is replaced, so the library's setup sees the module it expects)."""
    step = build(_CompiledSteps(gpt), model, *args)
    model.forward = torch.compile(model.forward, backend="inductor", fullgraph=True, dynamic=False)
    return step


def _handwritten(gpt, model, mode):
    local, step = handwritten_step(_CompiledSteps(gpt), model, mode)
    local.forward = torch.compile(local.forward, backend="inductor", fullgraph=True, dynamic=False)
    return step


def _whole_step(gpt, model, mode):
    """The example's step as one program: ``sbp_torch.compile_step`` with Inductor, the batch laid out inside it."""
    optimizer, layout = train.sbp_torch_layout(gpt, model, mode)
    step = st.compile_step(
        functools.partial(gpt.step_loss, model, optimizer, layout=layout),
        model=model,
        optimizer=optimizer,
        backend="inductor",
    )
    return lambda idx, targets: step(idx, targets).item()


def _first_step_seconds(step, *batches) -> float:
    """The time of the first steps (one per batch), slowest rank (for a compiled model: its compilation and first
    run)."""
    dist.barrier()
    start = time.perf_counter()
    for batch in batches:
        step(*batch)
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def measure(world: int, quick: bool) -> list[dict]:
    # Compile times are cold: no compiled program is taken from an earlier run's on-disk caches.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    torch._inductor.config.bucket_all_reduces_fx = "all"
    torch._inductor.config.bucket_reduce_scatters_fx = "all"
    code = harness.code_state()
    gpt = load_example()
    warmup, repeats = (2, 8) if quick else (5, 30)
    first, *batches = gpt.batches(warmup + repeats + 2)
    torch.manual_seed(0)
    initial = gpt.GPT()
    reference = copy.deepcopy(initial)
    optimizer = gpt.make_optimizer(reference)
    want = [gpt.train_step(reference, optimizer, *b) for b in [first, *batches]]
    rows = []
    for mode in MODES:
        torch._dynamo.reset()
        dtensor = train.DTENSOR_STEPS[mode]
        steps = {
            "sbp_torch eager": train.sbp_torch_step(gpt, copy.deepcopy(initial), mode),
            "sbp_torch compiled": _compiled(lambda g, m: train.sbp_torch_step(g, m, mode), gpt, copy.deepcopy(initial)),
            WHOLE: _whole_step(gpt, copy.deepcopy(initial), mode),
            "DTensor eager": dtensor(gpt, copy.deepcopy(initial)),
            "DTensor compiled": _compiled(dtensor, gpt, copy.deepcopy(initial)),
            "hand-written compiled": _handwritten(gpt, copy.deepcopy(initial), mode),
        }
        losses = {name: [] for name in steps}
        first_step = {}
        for name, step in steps.items():
            try:
                firsts = (first, batches[0]) if name == WHOLE else (first,)
                first_step[name] = _first_step_seconds(lambda *b, s=step, n=name: losses[n].append(s(*b)), *firsts)
            except Exception as err:  # a library that cannot compile this mode: reported, not timed
                first_step[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        runnable = {n: s for n, s in steps.items() if not isinstance(first_step[n], str)}
        feeds = {n: iter(batches[1:] if n == WHOLE else batches) for n in runnable}
        calls = {n: (lambda n=n, s=s: losses[n].append(s(*next(feeds[n])))) for n, s in runnable.items()}
        stats = harness.timed_interleaved(calls, repeats, warmup)
        for name in steps:
            row = {"world": world, "mode": mode, "variant": name, "code": code, "load": os.getloadavg()[0]}
            if name in stats:
                row.update(
                    step=stats[name],
                    first_step_s=first_step[name],
                    max_rel_diff=max(abs(g - w) / abs(w) for g, w in zip(losses[name], want)),
                )
            else:
                row["error"] = first_step[name]
            rows.append(row)
            if dist.get_rank() == 0:
                shown = f"{1e6 / row['step']['median_us']:.2f} steps/s" if "step" in row else row["error"]
                print(f"  {mode:6} {name:19} {shown}", flush=True)
    return rows


def _compile_ratio(a: dict | None, b: dict | None) -> str:
    if not a or not b or "step" not in a or "step" not in b:
        return "—"
    return f"{a['first_step_s'] / b['first_step_s']:.2f}x"


def report(rows: list[dict]) -> str:
    by = {(r["mode"], r["variant"]): r for r in rows}
    table, compile_rows, errors = [], [], []
    for mode in MODES:
        row = [harness.LAYOUT_NAMES[mode]] + [harness.fmt_rate(by.get((mode, v), {}).get("step")) for v in VARIANTS]
        sbp_c, sbp_e, whole, dt_c, floor = (
            by.get((mode, v))
            for v in ("sbp_torch compiled", "sbp_torch eager", WHOLE, "DTensor compiled", "hand-written compiled")
        )
        row += [harness.rate_ratio(sbp_c, sbp_e), harness.rate_ratio(sbp_c, dt_c), harness.rate_ratio(sbp_c, floor)]
        row += [harness.rate_ratio(whole, dt_c), harness.rate_ratio(whole, floor)]
        table.append(row)
        compile_rows.append(
            [harness.LAYOUT_NAMES[mode]]
            + [
                f"{by[(mode, v)]['first_step_s']:.1f}" if "step" in by.get((mode, v), {}) else "—"
                for v in ("sbp_torch compiled", WHOLE, "DTensor compiled", "hand-written compiled")
            ]
            + [
                _compile_ratio(by.get((mode, v)), by.get((mode, "hand-written compiled")))
                for v in ("sbp_torch compiled", WHOLE)
            ]
            + [", ".join(f"{by[(mode, v)]['max_rel_diff']:.1e}" for v in VARIANTS if "step" in by.get((mode, v), {}))]
        )
        errors += [
            f"- {harness.LAYOUT_NAMES[mode]}, {v}: `{by[(mode, v)]['error']}`"
            for v in VARIANTS
            if "error" in by.get((mode, v), {})
        ]
    lines = [
        "Steps per second of one training step of `examples/gpt.py` on 4 CPU ranks, median (quartiles), the "
        'slowest rank\'s; compiled = forward and backward through `torch.compile(..., backend="inductor", '
        "fullgraph=True, dynamic=False)` and the optimizer step through `torch.compile`; compile_step = the whole "
        "step (batch layout, forward, backward, AdamW) as one Inductor program by `sbp_torch.compile_step`; "
        "hand-written = the same model and collectives on plain tensors per rank "
        "(`benchmarks/suites/handwritten_gpt.py`), compiled as sbp_torch compiled is. "
        "Written by `benchmarks/suites/compile.py`.",
        "",
        harness.markdown_table(
            [
                "mode",
                *VARIANTS,
                "sbp_torch compiled / eager",
                "/ DTensor compiled",
                "/ hand-written compiled",
                "compile_step / DTensor compiled",
                "/ hand-written compiled",
            ],
            table,
        ),
        "",
        "First step (compilation included, on-disk compile caches off; for compile_step its first two steps, the "
        "eager one and the one that traces and compiles), seconds, slowest rank; and the largest "
        "relative difference of each variant's losses from single-process training (in the order of the table):",
        "",
        harness.markdown_table(
            [
                "mode",
                "sbp_torch compiled",
                "sbp_torch compile_step",
                "DTensor compiled",
                "hand-written compiled",
                "sbp_torch compiled / hand-written",
                "compile_step / hand-written",
                "loss rel. diff",
            ],
            compile_rows,
        ),  # fmt: skip
        "",
    ]
    if errors:
        lines += ["Variants that did not run:", "", *errors, ""]
    lines += [f"Code measured: {rows[0]['code'] if rows else '?'}. {harness.load_note(rows)}"]
    return "\n".join(lines)
