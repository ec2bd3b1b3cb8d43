"""Training steps per second of the model zoo: each model of ``zoo/dense.py`` in each of its layouts,
with sbp_torch and with DTensor on 4 ranks, beside the same model trained by one process.

The zoo's models are unmodified Hugging Face ``transformers`` models (tiny configs, random weights); ``LAYOUTS``
lays each out three ways on 4 ranks: ``dp`` (every tensor broadcast, the batch split over 4), ``tp`` (the
Megatron-style plan of the model's linears over 4, the batch broadcast) and ``2d`` (a 2x2 grid: the batch split
over its rows, the tensor-parallel plan over its columns). A step is what ``zoo.training.train`` does once: lay out
the batch (8 rows: ``ROWS``), forward, ``zero_grad``, backward, AdamW ``step()`` and the loss as a Python number.
Every variant of a model trains a copy of the same initial weights on the same batches, warm-up steps included,
and its losses are compared step by step with ``zoo.training.train`` run by one process (recomputed in every rank
of the 4-rank launch): the largest relative difference is recorded, so that a fast but wrong variant shows. Times
are the slowest rank's, median and quartiles over the timed steps, after a few warm-up steps (first-step caches and
optimizer state excluded). There are few steps per variant: the point is a picture over many models, not a
precise number for one.

* ``plain``: the unmodified model trained by one process, in its own one-rank launch on one thread (as the train
  suite's baseline, and like each of the 4 ranks: these models are far too small to gain from intra-op threads).
* ``sbp_torch``: ``zoo.dense.lay_out(model, layout)``, i.e. ``Module.to_global(placement, layout.plan(model))``;
  the batch is broadcast from the same values and then laid out with the layout's batch SBP.
* ``DTensor``: the same plan taken literally. A ``DeviceMesh`` of the layout's ranks (1-D of 4 for ``dp`` and
  ``tp``, 2x2 for ``2d``); every parameter and buffer is ``distribute_tensor``-ed with the placements mapped from
  the SBP that sbp_torch gives it (``sbp_for``: broadcast -> ``Replicate()``, split(d) -> ``Shard(d)``), tied
  tensors kept tied, parameters re-wrapped as ``nn.Parameter``; the batch is ``distribute_tensor(t, mesh,
  placements)`` of the layout's batch SBP mapped the same way. Forward and backward run under
  ``implicit_replication()``, since the models build plain tensors (positions, masks) inside ``forward``. Nothing
  is added after backward: gradients are left as DTensor's propagation makes them (``Partial`` where the batch was
  split) and the optimizer's ops redistribute them by DTensor's own rules. The loss is read as
  ``loss.full_tensor().item()``. This is not how one would tune DTensor for a model (``parallelize_module`` with
  parallel styles, bucketed gradient reduction: the train suite does that for the GPT example); it is what
  DTensor does with the same plan and no model changes, which is what ``Module.to_global`` is asked to do.

DTensor fails on some models; a failure (in the layout or in any step) is caught on every rank, the ranks agree on
it, and the table shows the first line of the error instead of a time, with the innermost frame outside torch
that raised it (the model's line, or the step's call such as ``loss.backward()``). sbp_torch is guarded the
same way. The two libraries take turns within each model and layout (one step each per round), so that a shared
machine's changing load falls on both alike. The 4 ranks share this machine's cores, so on a small machine
parallel steps/s measure overhead, not speed-up.
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor import Partial as DTensorPartial
from torch.distributed.tensor.experimental import implicit_replication

import sbp_torch as st
from benchmarks import harness
from sbp_torch._api._module import sbp_for
from sbp_torch.sbp import Broadcast, Partial, Split, broadcast
from zoo import dense, training

TITLE = "Model zoo: training steps of Hugging Face models with sbp_torch, DTensor and one process"
WORLDS = [1, 4]
STEPS, QUICK_STEPS = (3, 10), (2, 4)  # (warm-up, timed) steps per variant
QUICK_MODELS = 2  # the first models of the zoo, with --quick
# Rows per batch: even over the 4 data-parallel ranks and the 2 rows of the grid, as a tuned data-parallel run is.
# (The zoo test's 6 rows split unevenly, which is correct but slow: a batch of 6 over 4 ranks cannot stay split
# through the (batch, sequence) -> (tokens,) flattening before each linear, so it is re-laid out there.)
ROWS = 8


def _placements(sbp: tuple) -> list:
    """An sbp_torch SBP tuple as DTensor placements."""

    def one(s):
        if isinstance(s, Broadcast):
            return Replicate()
        if isinstance(s, Split):
            return Shard(s.dim)
        if isinstance(s, Partial):
            return DTensorPartial(s.op)
        raise TypeError(f"no DTensor placement for {s!r}")

    return [one(s) for s in sbp]


def _distribute_model(model: nn.Module, mesh: DeviceMesh, plan, placement) -> nn.Module:
    """Every parameter and buffer as a DTensor laid out as sbp_torch would lay it out under ``plan``, in place."""
    memo: dict = {}
    for prefix, sub in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            table = getattr(sub, kind)
            for name, tensor in list(table.items()):
                if tensor is None:
                    continue
                if id(tensor) not in memo:  # tied tensors stay tied (the first name's plan wins, as in sbp_torch)
                    full_name = f"{prefix}.{name}" if prefix else name
                    placements = _placements(sbp_for(full_name, tensor, plan, placement))
                    value = distribute_tensor(tensor.detach(), mesh, placements)
                    if isinstance(tensor, nn.Parameter):
                        value = nn.Parameter(value, requires_grad=tensor.requires_grad)
                    memo[id(tensor)] = value
                table[name] = memo[id(tensor)]
    return model


def _dtensor_step(zoo_model, layout, mesh: DeviceMesh):
    placement = st.placement("cpu", layout.ranks)
    plan = layout.plan(zoo_model)
    if plan is None:  # as Module.to_global: everything broadcast
        plan = (broadcast,) * placement.ndim
    model = _distribute_model(dense.make(zoo_model), mesh, plan, placement)
    batch_placements = _placements(layout.batch_sbp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # as zoo.training.trainer

    def step(batch):
        with implicit_replication():  # the models build plain tensors in forward
            loss = model(**{k: distribute_tensor(v, mesh, batch_placements) for k, v in batch.items()}).loss
            optimizer.zero_grad()
            loss.backward()
        optimizer.step()
        return loss.full_tensor().item() if isinstance(loss, DTensor) else loss.item()

    return step


def _train_plain(zoo_model, batches, warmup: int, repeats: int) -> tuple[dict, list[float]]:
    step, feed, losses = training.trainer(dense.make(zoo_model)), iter(batches), []
    stats = harness.timed_interleaved({"plain": lambda: losses.append(step(next(feed)))}, repeats, warmup)
    return stats["plain"], losses


def measure(world: int, quick: bool) -> list[dict]:
    code = harness.code_state()  # at the start: the code this process imported
    warmup, repeats = QUICK_STEPS if quick else STEPS
    models = dense.ZOO[:QUICK_MODELS] if quick else dense.ZOO
    rows = []
    if world == 1:
        torch.set_num_threads(1)  # see the module docstring
        for zoo_model in models:
            batches = dense.batches(zoo_model, warmup + repeats, rows=ROWS)
            stats, losses = _train_plain(zoo_model, batches, warmup, repeats)
            rows.append(
                {
                    "world": 1,
                    "model": zoo_model.name,
                    "library": "plain",
                    "layout": "one process",
                    "step": stats,
                    "losses": losses,
                    "threads": torch.get_num_threads(),
                    "code": code,
                    "load": os.getloadavg()[0],
                }
            )
            print(f"  {zoo_model.name:9} plain     {1e6 / stats['median_us']:7.2f} steps/s", flush=True)
        return rows
    meshes = {layout.name: DeviceMesh("cpu", layout.ranks) for layout in dense.LAYOUTS}  # once: new groups
    for zoo_model in models:
        batches = dense.batches(zoo_model, warmup + repeats, rows=ROWS)
        want, _ = training.train(dense.make(zoo_model), batches)
        for layout in dense.LAYOUTS:
            steps = {
                "sbp_torch": harness.Guarded(lambda: training.trainer(*dense.lay_out(zoo_model, layout)), __file__),
                "dtensor": harness.Guarded(lambda: _dtensor_step(zoo_model, layout, meshes[layout.name]), __file__),
            }
            for library, (stats, guarded) in harness.train_in_turns(steps, batches, warmup, repeats).items():
                ok = guarded.error is None
                rows.append(
                    {
                        "world": world,
                        "model": zoo_model.name,
                        "library": library,
                        "layout": layout.name,
                        "step": stats,
                        "error": guarded.error,
                        "losses": guarded.losses,
                        "max_rel_diff": harness.relative_difference(guarded.losses, want) if ok else None,
                        "threads": torch.get_num_threads(),
                        "code": code,
                        "load": os.getloadavg()[0],
                    }
                )
                if dist.get_rank() == 0:
                    what = (
                        f"{1e6 / stats['median_us']:7.2f} steps/s, losses differ from one process by "
                        f"{rows[-1]['max_rel_diff']:.1e}"
                        if ok
                        else f"fails: {guarded.error}"
                    )
                    print(f"  {zoo_model.name:9} {layout.name:3} {library:9} {what}", flush=True)
    return rows


def _cell(row: dict | None) -> str:
    if row is None:
        return "—"
    if row["error"] is not None:
        return "fails: " + row["error"].replace("|", "\\|")
    return harness.fmt_rate(row["step"])


def _diff(row: dict | None) -> str:
    return "—" if not row or row["max_rel_diff"] is None else f"{row['max_rel_diff']:.1e}"


def report(rows: list[dict]) -> str:
    by = {(r["model"], r["library"], r["layout"]): r for r in rows}
    models = list(dict.fromkeys(r["model"] for r in rows))
    header = [
        "model",
        "layout",
        "plain steps/s",
        "sbp_torch steps/s",
        "DTensor steps/s",
        "sbp_torch / DTensor",
        "loss rel. diff sbp_torch, DTensor",
    ]
    table, ratios = [], []
    for model in models:
        plain = by.get((model, "plain", "one process"))
        for layout in (lay.name for lay in dense.LAYOUTS):
            sbp, dt = by.get((model, "sbp_torch", layout)), by.get((model, "dtensor", layout))
            if not sbp and not dt:
                continue
            table.append(
                [
                    model,
                    harness.LAYOUT_NAMES[layout],
                    harness.fmt_rate(plain["step"]) if plain else "—",
                    _cell(sbp),
                    _cell(dt),
                    harness.rate_ratio(sbp, dt),
                    f"{_diff(sbp)}, {_diff(dt)}",
                ]
            )
            if sbp and dt and sbp["step"] and dt["step"]:
                ratios.append(dt["step"]["median_us"] / sbp["step"]["median_us"])
    lines = [
        "Steps per second of one training step (lay out the batch, forward, backward, AdamW, read the loss) of each "
        "model of `zoo/dense.py`, median (quartiles) over the timed steps, each the slowest rank's; "
        "`plain` is one process. Written by `benchmarks/suites/zoo.py`; its docstring gives the DTensor setup.",
        "",
        harness.markdown_table(header, table),
        "",
    ]
    four = [r for r in rows if r["world"] == 4]
    ran = [r for r in four if r["error"] is None]
    if four:
        counts = {
            name: (sum(r["error"] is None for r in four if r["library"] == lib), sum(r["library"] == lib for r in four))
            for lib, name in (("sbp_torch", "sbp_torch"), ("dtensor", "DTensor"))
        }
        text = ", ".join(f"{name} {ok} of {n}" for name, (ok, n) in counts.items())
        lines += [f"Model x layout cases that trained: {text}."]
        if ratios:
            geo = statistics.geometric_mean(ratios)
            lines += [
                f"Where both trained, sbp_torch / DTensor steps/s ranges from {min(ratios):.2f}x to "
                f"{max(ratios):.2f}x (geometric mean {geo:.2f}x over {len(ratios)} cases)."
            ]
        lines += [""]
    if ran:
        steps = len(ran[0]["losses"])
        text = (
            f"Loss differences: largest relative difference from single-process training (`zoo.training.train`, "
            f"recomputed in each rank of the 4-rank launch) over all {steps} steps, warm-up included."
        )
        plain = {r["model"]: r["losses"] for r in rows if r["library"] == "plain"}
        own = [harness.relative_difference(r["losses"], plain[r["model"]]) for r in ran if r["model"] in plain]
        if own:  # the one-process launch trained the same way, timed
            text += f" Against the one-process launch's own losses the largest is {max(own):.1e}."
        lines += [text, ""]
    threads = statistics.mode(r["threads"] for r in four) if four else "?"
    plain_threads = [r["threads"] for r in rows if r["library"] == "plain"]
    lines += [
        f"One process runs {harness.threads(plain_threads[0]) if plain_threads else '?'}, the 4 ranks "
        f"{harness.threads(threads)} each. Code measured: {rows[0]['code'] if rows else '?'}. {harness.load_note(rows)}"
    ]
    return "\n".join(lines)
