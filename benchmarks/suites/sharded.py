"""Sharded data parallelism on 4 CPU ranks: sbp_torch's ``Module.to_global(shard=0)`` beside FSDP2 and beside
replicated data parallelism, on the GPT example and a ``transformers`` model of the zoo.

Two models, float32, each trained by AdamW (``foreach=True``, lr 3e-3, weight decay 0.1) on the same batches from the
same initial weights in every variant:

* the GPT example (``examples/gpt.py``, its sizes set here: width 128, 4 heads, context 32, 4 blocks, 2 with
  ``--quick``), batch 8;
* the zoo's Qwen2 (``zoo/dense.py``: a Llama-style decoder, its tiny config; ``use_cache=False``, as in training),
  batch 8.

In both, sbp_torch's blocks compute nothing that communicates, so they run as plain PyTorch on the parts
(``_api/_plain_units.py``) from the third step on.

Variants (the batch is the same 8 rows; each rank computes on 2 of them):

* ``replicated``: ``model.to_global(placement)``: every parameter broadcast, the batch laid out ``split(0)``
  (from the whole batch, which every rank holds alike, promised so: ``check_meta=False, sync_data=False`` send
  nothing, as FSDP2's ranks take their rows); gradients all-reduced in buckets.
* ``sharded``: ``model.to_global(placement, shard=0)``: parameters stored ``split`` over the 4 ranks, gathered per
  unit (the root and each block) when used; gradients reduce-scattered per unit. Batch as ``replicated``.
* ``FSDP2``: ``torch.distributed.fsdp.fully_shard`` on every block, then on the root, on
  ``init_device_mesh("cpu", (4,))``; each rank runs its plain slice of the batch (rows ``2r, 2r+1``). Its loss is
  this slice's, so the step all-reduces it (one extra small collective) to report the batch's mean, as the sbp_torch
  variants' ``loss.item()`` does.
* ``sharded bf16`` and ``FSDP2 bf16``: the same with ``MixedPrecision(param_dtype=torch.bfloat16,
  reduce_dtype=torch.float32)`` and FSDP2's ``MixedPrecisionPolicy`` with the same dtypes: parameters stored and
  updated in float32, gathered and computed in bfloat16, gradients reduced in float32.

Measured, per variant:

* **Peak memory per rank** during one training step. On the CPU there are no allocator statistics, so the variant is
  built (model copy, layout or ``fully_shard``, optimizer) and trained for two steps under ``torch.profiler`` with
  ``profile_memory=True``; the profiler reports every allocation and free of tensor memory through c10's CPU
  allocator on the training thread, with its size and time. Summing them in time order gives the bytes this variant
  holds at each moment (everything it allocated since its build began: stored parameters, gradients, AdamW state,
  gathered copies, activations, collective buffers, caches); the peak is the largest sum during the third step
  (the first creates the AdamW state and fills caches, the second learns which blocks run as plain PyTorch).
  Allocations made inside gloo's own worker threads (its internal copies during a collective) are not seen, for any
  variant. The step is a normal step: its loss counts.
* **Stored bytes per rank**: this rank's parts of the parameters, gradients and AdamW state (``exp_avg``,
  ``exp_avg_sq``, ``step``) after a step.
* **Step time**: lay out the batch, forward, ``zero_grad``, backward (with the gradient reduction),
  ``optimizer.step()`` and the loss as a Python number; the slowest rank's, median and quartiles over the timed
  steps, after warm-up. The variants take turns (one step each per round), so that a shared machine's changing load
  falls on all alike. The 4 ranks share this machine's cores (one thread each): on a small machine the times
  measure overhead and communication, not speed-up.
* **Losses**: every step's (the profiled ones and warm-up included) against single-process training of the same
  model on the same batches, recomputed in every rank (largest relative difference); the bf16 variants also against
  their own library's float32 run.

A variant that fails (in its build or any step, on any rank) is reported in its row with the error's first line and
where it was raised; the others still run.

Targets (the issue), reported, not asserted: sbp_torch sharded peak memory per rank ≤ 1.05x FSDP2's, and ≤ a quarter
of the replicated run's parameter + gradient + AdamW bytes plus one block's gathered parameters; step time ≤ 1.0x
FSDP2's; losses within 1e-5 relative of one process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile, record_function

import sbp_torch as st
from benchmarks import harness
from sbp_torch._api._sharding import MixedPrecision
from sbp_torch.sbp import broadcast, split
from zoo import dense
from zoo.gpt import load_example

TITLE = "Sharded data parallelism: sbp_torch's Module.to_global(shard=0), FSDP2 and replicated data parallelism"
WORLDS = [4]
VARIANTS = ["replicated", "sharded", "FSDP2", "sharded bf16", "FSDP2 bf16"]
BF16_OF = {"sharded bf16": "sharded", "FSDP2 bf16": "FSDP2"}  # a bf16 variant -> its float32 run
ROWS = 8  # batch rows: 2 per rank
PROFILED = 3  # steps of the memory run; the third is measured (the second learns which blocks run plain)
STEPS, QUICK_STEPS = (3, 20), (1, 5)  # (warm-up, timed) steps after the profiled ones
MEMORY_TARGET, TIME_TARGET, LOSS_TOLERANCE = 1.05, 1.0, 1e-5


@dataclass(frozen=True)
class Case:
    """A model to train: how to build it (the same weights every call), its batches, its loss, its blocks."""

    name: str
    make: Callable[[], nn.Module]
    batches: Callable[[int], list[dict]]  # steps -> that many batches of ROWS rows (keyword arguments of ``loss``)
    loss: Callable[[nn.Module, dict], torch.Tensor]
    blocks: Callable[[nn.Module], list[nn.Module]]  # the modules FSDP2 shards one by one (sbp_torch's units)
    sizes: str  # for the report


def _gpt_case(quick: bool) -> Case:
    gpt = load_example()  # a fresh module: its sizes are module constants, set here before building
    gpt.CONTEXT, gpt.WIDTH, gpt.HEADS = 32, 128, 4
    layers = 2 if quick else 4

    def make():
        torch.manual_seed(0)
        return gpt.GPT(layers)

    def batches(steps):
        return [{"idx": idx, "targets": targets} for idx, targets in gpt.batches(steps, ROWS)]

    return Case(
        "GPT example",
        make,
        batches,
        lambda model, b: model(b["idx"], b["targets"]),
        lambda model: list(model.blocks),
        f"{layers} blocks, width {gpt.WIDTH}, {gpt.HEADS} heads, context {gpt.CONTEXT}, vocabulary {gpt.VOCAB}",
    )


def _zoo_case() -> Case:
    qwen2 = next(m for m in dense.ZOO if m.name == "qwen2")
    return Case(
        "transformers Qwen2 (zoo)",
        lambda: _without_cache(dense.make(qwen2)),
        lambda steps: dense.batches(qwen2, steps, rows=ROWS),
        lambda model, b: model(**b).loss,
        lambda model: list(model.model.layers),
        f"2 layers, hidden 32, 4 heads (2 key/value), sequence {dense.SEQ}, vocabulary {dense.VOCAB}",
    )


def _without_cache(model: nn.Module) -> nn.Module:
    model.config.use_cache = False  # (training: no key/value cache, which a block would fill; every variant alike)
    return model


def _adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=True)


class _Trainer:
    """A model as a variant lays it out, its optimizer, and its training step ``(batch) -> loss``."""

    def __init__(self, model: nn.Module, lay_out: Callable[[dict], dict], mean_of_ranks: bool, loss):
        self.model, self.optimizer = model, _adamw(model)
        self.lay_out, self.mean_of_ranks, self.loss = lay_out, mean_of_ranks, loss

    def step(self, batch: dict) -> float:
        loss = self.loss(self.model, self.lay_out(batch))
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        if not self.mean_of_ranks:
            return loss.item()
        mean = loss.detach().float().clone()  # this rank's slice's loss: the batch's is the mean over ranks
        dist.all_reduce(mean)
        return mean.item() / dist.get_world_size()

    def stored_bytes(self) -> int:
        """This rank's bytes of parameters, gradients and optimizer state."""
        tensors = list(self.model.parameters())
        tensors += [p.grad for p in tensors if p.grad is not None]
        tensors += [t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to_local() if isinstance(t, (st.GlobalTensor, DTensor)) else t


def _sbp_torch(case: Case, shard: int | None, mixed_precision: MixedPrecision | None) -> _Trainer:
    placement = st.placement("cpu", list(range(dist.get_world_size())))
    model = case.make().to_global(placement, shard=shard, mixed_precision=mixed_precision)

    def lay_out(batch):
        return {
            k: v.to_global(placement, broadcast, check_meta=False, sync_data=False).to_global(sbp=split(0))
            for k, v in batch.items()
        }

    return _Trainer(model, lay_out, False, case.loss)


def _fsdp2(case: Case, mesh, policy: MixedPrecisionPolicy) -> _Trainer:
    model = case.make()
    for block in case.blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    rank, world = dist.get_rank(), dist.get_world_size()
    return _Trainer(model, lambda batch: {k: v.chunk(world)[rank] for k, v in batch.items()}, True, case.loss)


def _builders(case: Case, mesh) -> dict[str, Callable[[], _Trainer]]:
    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return {
        "replicated": lambda: _sbp_torch(case, None, None),
        "sharded": lambda: _sbp_torch(case, 0, None),
        "FSDP2": lambda: _fsdp2(case, mesh, MixedPrecisionPolicy()),
        "sharded bf16": lambda: _sbp_torch(case, 0, MixedPrecision(**bf16)),
        "FSDP2 bf16": lambda: _fsdp2(case, mesh, MixedPrecisionPolicy(**bf16)),
    }


class _Variant:
    """One variant's trainer, built and trained for ``PROFILED`` steps under the memory profiler; then a training
    step that stops at its first exception (the error kept, later calls doing nothing). The interface of
    ``harness.Guarded`` (``error``, ``losses``, ``agree``, call), so that ``harness.train_in_turns`` times it."""

    def __init__(self, build: Callable[[], _Trainer], batches: list[dict]):
        self.error: str | None = None
        self.losses: list[float] = []
        self.memory: dict = {}
        self.trainer = None
        try:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                self.trainer = build()
                for i, batch in enumerate(batches):
                    with record_function(harness.MEASURED if i == len(batches) - 1 else "step"):
                        self.losses.append(self.trainer.step(batch))
            self.memory = harness.peak_memory(prof)
            self.memory["stored"] = self.trainer.stored_bytes()
            sharded = getattr(self.trainer.model, "_sbp_torch_sharded", None)
            if sharded is not None:
                self.memory.update(sharded.memory())
        except Exception as err:
            self.error = harness.first_line(err, __file__)

    def __call__(self, batch: dict) -> None:
        if self.error is None:
            try:
                self.losses.append(self.trainer.step(batch))
            except Exception as err:
                self.error = harness.first_line(err, __file__)

    def agree(self) -> None:
        """Make every rank see a failure of any rank (the message of the lowest rank that failed)."""
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, self.error)
        self.error = next((e for e in errors if e is not None), None)


def _block_bytes(case: Case, dtype: torch.dtype) -> int:
    """Bytes of one block's parameters gathered in ``dtype`` (the largest block's)."""
    return max(sum(p.numel() for p in block.parameters()) for block in case.blocks(case.make())) * dtype.itemsize


def _reference_losses(case: Case, batches: list[dict]) -> list[float]:
    """Single-process training of the same model on the same batches."""
    trainer = _Trainer(case.make(), lambda batch: batch, False, case.loss)
    return [trainer.step(batch) for batch in batches]


def _timeline(case: Case, batches: list[dict]) -> list[tuple[float, str, str]]:
    """One sharded training step's events on this rank (after two steps that fill the caches), times in ms from the
    step's start: each unit's gathers, forward, backward and gradient reduce-scatter."""
    trainer = _sbp_torch(case, 0, None)
    for batch in batches[:2]:
        trainer.step(batch)
    events: list = []
    trainer.model._sbp_torch_sharded.record_timeline(events)
    start = time.perf_counter()
    trainer.step(batches[2])
    trainer.model._sbp_torch_sharded.record_timeline(None)
    return [(round((t - start) * 1e3, 2), unit or "root", event) for t, unit, event in events]


# What a timeline's row shows between two events of its unit, drawn in this order (later ones on top).
SPANS = [("gather begun", "gathered", "g"), ("forward begun", "forward done", "F"),
         ("gathered", "backward done", "B"), ("reduce-scatter begun", "reduced", "r")]  # fmt: skip


def _render_timeline(events: list, width: int = 96) -> str:
    """A text chart, a row per unit: ``g`` a gather in flight, ``F`` its forward, ``B`` its backward (from its
    parameters gathered again to its gradients made), ``r`` its gradients' reduce-scatter in flight."""
    end = max(t for t, _, _ in events) or 1.0
    units = list(dict.fromkeys(u for _, u, _ in events))
    lines = []
    for unit in units:
        row = [" "] * width
        mine = [(t, e) for t, u, e in events if u == unit]
        for first, last, mark in SPANS:
            for i, (t, e) in enumerate(mine):
                if e != first:
                    continue
                if mark == "B" and not any(e2 == "forward done" for _, e2 in mine[:i]):
                    continue  # a gather for the forward, not the backward
                stop = next((t2 for t2, e2 in mine[i + 1 :] if e2 == last), t)
                for c in range(int(t / end * (width - 1)), int(stop / end * (width - 1)) + 1):
                    row[c] = mark
        lines.append(f"{unit:10} |{''.join(row)}|")
    lines.append(f"{'':10}  0 ms{' ' * (width - 12)}{end:6.1f} ms")
    return "\n".join(lines)


def measure(world: int, quick: bool) -> list[dict]:
    code = harness.code_state()  # at the start: the code this process imported
    warmup, repeats = QUICK_STEPS if quick else STEPS
    mesh = init_device_mesh("cpu", (world,))
    rows = []
    for case in (_gpt_case(quick), _zoo_case()):
        batches = case.batches(PROFILED + warmup + repeats)
        want = _reference_losses(case, batches)
        variants = {name: _Variant(build, batches[:PROFILED]) for name, build in _builders(case, mesh).items()}
        timed = harness.train_in_turns(variants, batches[PROFILED:], warmup, repeats)
        for name, (stats, variant) in timed.items():
            ok = variant.error is None
            rows.append(
                {
                    "world": world,
                    "model": case.name,
                    "sizes": case.sizes,
                    "variant": name,
                    "step": stats,
                    "error": variant.error,
                    "memory": variant.memory if ok else None,
                    "losses": variant.losses,
                    "max_rel_diff": harness.relative_difference(variant.losses, want) if ok else None,
                    "block_bytes": {d: _block_bytes(case, getattr(torch, d)) for d in ("float32", "bfloat16")},
                    "threads": torch.get_num_threads(),
                    "code": code,
                    "load": os.getloadavg()[0],
                }
            )
            if dist.get_rank() == 0:
                what = (
                    f"{stats['median_us'] / 1e3:8.1f} ms, peak {variant.memory['peak'] / 2**20:.2f} MiB, "
                    f"stored {variant.memory['stored'] / 2**20:.2f} MiB, "
                    f"losses differ by {rows[-1]['max_rel_diff']:.1e}"
                    if ok
                    else f"failed: {variant.error}"
                )
                print(f"  {case.name:26} {name:13} {what}", flush=True)
        if case.name == "GPT example":
            timeline = _timeline(case, batches)
            next(r for r in rows if r["model"] == case.name and r["variant"] == "sharded")["timeline"] = timeline
        for name, fp32 in BF16_OF.items():  # bf16 spread against the same library's float32 run
            got, base = (next(r for r in rows[-len(VARIANTS) :] if r["variant"] == v) for v in (name, fp32))
            if got["error"] is None and base["error"] is None:
                got["rel_diff_to_fp32"] = harness.relative_difference(got["losses"], base["losses"])
    return rows


def _mib(n: int | None) -> str:
    return "—" if n is None else f"{n / 2**20:.3f}"


def _over(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "—"


def report(rows: list[dict]) -> str:
    parts = [
        "Per-rank numbers of rank 0 on 4 CPU ranks (gloo), AdamW (foreach). **Step**: median (quartiles) of the timed "
        "steps, each the slowest rank's; **peak**: the most bytes the variant held during one training step, counted "
        "from torch.profiler's allocation events (`profile_memory=True`: every tensor allocation and free through "
        "c10's CPU allocator on the training thread since the variant's build began; gloo's internal copies in its "
        "own threads are not seen, for any variant; a block whose free happened on such a thread counts as freed "
        "when its address is reused); **held between steps**: the same count as the measured step starts; "
        "**stored**: this rank's parameters + gradients + AdamW state; "
        "**gathered peak**: sbp_torch's own count of gathered copies alive at once (`_sbp_torch_sharded.memory()`). "
        "Losses: largest relative difference from one process over all steps; for bf16 also from the same "
        "library's float32 run. Written by `benchmarks/suites/sharded.py`; its docstring says how each variant is set "
        "up and measured.",
    ]
    for model in dict.fromkeys(r["model"] for r in rows):
        by = {r["variant"]: r for r in rows if r["model"] == model}
        parts.append(f"### {model}\n\n{next(iter(by.values()))['sizes']}, batch {ROWS} rows (2 per rank).")
        table = []
        for name in VARIANTS:
            r = by.get(name)
            if r is None:
                continue
            if r["error"]:
                table.append([name, f"failed: {r['error']}"] + ["—"] * 7)
                continue
            m = r["memory"]
            vs_fsdp = by.get("FSDP2 bf16" if "bf16" in name else "FSDP2")
            fsdp_ok = vs_fsdp is not None and not vs_fsdp["error"] and vs_fsdp is not r
            table.append(
                [
                    name,
                    harness.fmt(r["step"], "ms"),
                    harness.ratio(r["step"], vs_fsdp["step"]) if fsdp_ok else "—",
                    _mib(m["peak"]),
                    _over(m["peak"], vs_fsdp["memory"]["peak"]) if fsdp_ok else "—",
                    _mib(m["at_step_start"]),
                    _mib(m["stored"]),
                    _mib(m.get("gathered_peak")),
                    f"{r['max_rel_diff']:.1e}"
                    + (f" ({r['rel_diff_to_fp32']:.1e} from fp32)" if "rel_diff_to_fp32" in r else ""),
                ]
            )
        header = [
            "variant",
            "step",
            "step / FSDP2",
            "peak MiB",
            "peak / FSDP2",
            "held between steps MiB",
            "stored MiB",
            "gathered peak MiB",
            "loss rel. diff",
        ]
        parts.append(harness.markdown_table(header, table))
        parts.append(_targets(by))
    for row in rows:
        if row.get("timeline"):
            parts.append(
                f"### One sharded step on rank 0, {row['model']}\n\nEach row a unit: `g` its parameters' all-gather "
                "in flight, `F` its forward, `B` its backward (from its parameters gathered again to its gradients "
                "made), `r` its gradients' reduce-scatter in flight. A gather that begins while another unit computes "
                "overlaps that compute.\n\n```\n" + _render_timeline(row["timeline"]) + "\n```"
            )
    four = [r for r in rows if r["world"] == 4]
    parts.append(
        f"Each rank uses {four[0]['threads'] if four else '?'} thread(s); the 4 ranks share the machine's cores. "
        f"Code measured: {rows[0]['code'] if rows else '?'}. {harness.load_note(rows)}"
    )
    return "\n\n".join(parts)


def _targets(by: dict) -> str:
    """The issue's targets for the sharded variants of one model, as sentences."""
    lines = []
    replicated = by.get("replicated")
    for name, fsdp_name, dtype in (("sharded", "FSDP2", "float32"), ("sharded bf16", "FSDP2 bf16", "bfloat16")):
        r, fsdp = by.get(name), by.get(fsdp_name)
        if r is None or r["error"] or fsdp is None or fsdp["error"]:
            continue
        peak = r["memory"]["peak"]
        memory_ratio = peak / fsdp["memory"]["peak"]
        time_ratio = r["step"]["median_us"] / fsdp["step"]["median_us"]
        text = (
            f"**Targets, {name}**: peak {memory_ratio:.2f}x FSDP2's (≤ {MEMORY_TARGET}x: "
            f"{'met' if memory_ratio <= MEMORY_TARGET else 'missed'}); "
        )
        if replicated and not replicated["error"]:
            block = r["block_bytes"][dtype]
            bound = replicated["memory"]["stored"] / 4 + block
            text += (
                f"peak {_mib(peak)} MiB against a quarter of the replicated run's stored "
                f"{_mib(replicated['memory']['stored'])} MiB plus one block's gathered parameters "
                f"({_mib(block)} MiB) = {_mib(int(bound))} MiB ({'met' if peak <= bound else 'missed'}); "
            )
        text += f"step {time_ratio:.2f}x FSDP2's (≤ {TIME_TARGET}x: {'met' if time_ratio <= TIME_TARGET else 'missed'})"
        if dtype == "float32":
            close = r["max_rel_diff"] <= LOSS_TOLERANCE
            verdict = "met" if close else "missed"
            text += f"; losses {r['max_rel_diff']:.1e} from one process (≤ {LOSS_TOLERANCE:.0e}: {verdict})"
        lines.append(text + ".")
    return "\n\n".join(lines)
