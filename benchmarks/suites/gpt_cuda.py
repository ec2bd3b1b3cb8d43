"""GPT training steps on one GPU: plain PyTorch, sbp_torch on a one-rank placement and DTensor on a one-device mesh,
eager and compiled, with and without CUDA graphs.

Two models, in float32, each trained by AdamW (``foreach=True``, eager in every variant, so that the variants differ in
the model's forward and backward only), at hidden 768, 12 heads, sequence 512, batch 8, vocabulary 50257, 6 layers
(2 with ``--quick``):

* the GPT example (``examples/gpt.py``, its sizes set to these): plain PyTorch modules, attention written out;
* an unmodified ``transformers`` GPT-2 with its default ``sdpa`` attention (CUDA's fused kernel), dropout off.

sbp_torch lays the model out with ``Module.to_global`` on a one-rank placement and the batch ``split(0)``: the global
program of data parallelism, on one rank. DTensor replicates every parameter (``distribute_module``) and shards the
batch, the model running under ``implicit_replication`` (GPT-2's forward builds plain tensors). Compiled means
``model.forward`` through ``torch.compile(backend="inductor", fullgraph=True, dynamic=False)``; with CUDA graphs,
``mode="reduce-overhead"``; compile_step = the whole step (forward, backward, AdamW) as one Inductor program by
``sbp_torch.compile_step``, set beside plain step compiled: the plain step function (forward, backward, AdamW)
through ``torch.compile``, which breaks its graph at the backward; compile_step + CUDA graphs = that program
replayed as one CUDA graph (``cuda_graphs=True``, AdamW then ``capturable``), set beside plain compiled with CUDA
graphs. Each variant's first three losses are compared
with plain eager's; then steps are timed (CUDA synchronised before each clock read), median and quartiles. Each row
is printed as it is measured, so that a run cut short still leaves what it had; a variant that fails is reported in
its row.

Target (the GPU issue): sbp_torch compiled with CUDA graphs within 1.02x of plain compiled with CUDA graphs, and
sbp_torch eager within 1.05x of plain eager.
Without a GPU the suite runs tiny models on the CPU (a smoke run: its times say nothing).
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch._dynamo

from benchmarks import harness
from zoo.gpt import MODELS, config, laid_out, make_model, whole_step

TITLE = "GPT training steps on one GPU: plain, sbp_torch and DTensor, eager and compiled (with CUDA graphs)"
WORLDS = [1]
NEEDS_CUDA = True
VARIANTS = [
    ("plain", "eager"),
    ("sbp_torch", "eager"),
    ("DTensor", "eager"),
    ("plain", "compiled"),
    ("sbp_torch", "compiled"),
    ("plain", "step compiled"),
    ("sbp_torch", "compile_step"),
    ("plain", "compiled + CUDA graphs"),
    ("sbp_torch", "compiled + CUDA graphs"),
    ("sbp_torch", "compile_step + CUDA graphs"),
]


# the plain variant a variant is divided by, where it is not its own way
_SAME_WAY = {"compile_step": "step compiled", "compile_step + CUDA graphs": "compiled + CUDA graphs"}


def _plain(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _measure_variant(name: str, library: str, how: str, c: dict, device: str, batches: list, sync) -> dict:
    torch._dynamo.reset()
    model, loss_of = make_model(name, c, device)
    model, lay_out, context = laid_out(library, model, device)
    if how.startswith("compile_step"):
        return _measure_whole_step(model, loss_of, lay_out, c, batches, sync, cuda_graphs="CUDA graphs" in how)
    if how not in ("eager", "step compiled"):
        mode = "reduce-overhead" if "CUDA graphs" in how else None
        model.forward = torch.compile(model.forward, backend="inductor", fullgraph=True, dynamic=False, mode=mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    laid_out_batches = [lay_out(ids) for ids in batches]

    def step(ids):
        with context():
            loss = loss_of(model, ids)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss

    if how == "step compiled":  # the whole step function; Dynamo breaks its graph at backward
        step = torch.compile(step, backend="inductor", dynamic=False)
    start = time.perf_counter()
    losses = [float(_plain(step(ids)).detach()) for ids in laid_out_batches]  # the first includes compilation
    first_s = time.perf_counter() - start
    stat = harness.timed_local(lambda: step(laid_out_batches[0]), repeats=c["repeats"], warmup=2, sync=sync)  # one rank
    return {"first_steps_s": round(first_s, 2), "losses": losses, **stat}


def _measure_whole_step(model, loss_of, lay_out, c: dict, batches: list, sync, cuda_graphs: bool) -> dict:
    """``whole_step`` with Inductor (its first call runs eagerly, its second traces and compiles, its third records
    the CUDA graph where there is one: all are in ``first_steps_s``)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    step = whole_step(model, loss_of, lay_out, optimizer, "inductor", cuda_graphs)
    start = time.perf_counter()
    losses = [float(_plain(step(ids)).detach()) for ids in batches]
    first_s = time.perf_counter() - start
    stat = harness.timed_local(lambda: step(batches[0]), repeats=c["repeats"], warmup=2, sync=sync)
    return {"first_steps_s": round(first_s, 2), "losses": losses, **stat}


def _chosen() -> list[tuple[str, str, str]]:
    """The (model, library, how) to measure, in order: all, or those ``GPT_CUDA_ONLY`` names (``model:library:how``,
    comma-separated), to measure again what a run cut short."""
    only = os.environ.get("GPT_CUDA_ONLY")
    every = [(name, library, how) for name in MODELS for library, how in VARIANTS]
    if not only:
        return every
    wanted = [tuple(item.split(":")) for item in only.split(",")]
    unknown = [w for w in wanted if w not in every]
    if unknown:
        raise ValueError(f"GPT_CUDA_ONLY names no variant of the suite: {unknown}")
    return wanted


def measure(world: int, quick: bool) -> list[dict]:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    c = config(cuda, quick)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, c["vocab"], (c["batch"], c["seq"]), generator=generator).to(device) for _ in range(3)]
    sync = torch.cuda.synchronize if cuda else None
    rows, code = [], harness.code_state()
    for name, library, how in _chosen():
        row = {"model": name, "library": library, "how": how, "config": c, "code": code}
        try:
            row.update(_measure_variant(name, library, how, c, device, batches, sync))
        except Exception as err:  # noqa: BLE001 - a variant that fails is reported, the others still run
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        print(json.dumps(row), flush=True)
        rows.append(row)
        torch._dynamo.reset()
        if cuda:
            torch.cuda.empty_cache()
    return rows


def report(rows: list[dict]) -> str:
    config = rows[0]["config"] if rows else {}
    parts = [
        f"{config.get('layers')} layers, hidden {config.get('hidden')}, sequence {config.get('seq')}, batch "
        f"{config.get('batch')}, vocabulary {config.get('vocab')}, float32, AdamW (foreach, eager). Step time: median "
        f"(quartiles) of {config.get('repeats')} steps. `/ plain, same way` divides by plain PyTorch run the same way "
        "(eager, compiled, or compiled with CUDA graphs; compile_step: step compiled; compile_step + CUDA graphs: "
        "compiled + CUDA graphs)."
    ]
    codes = {r.get("run", 1): r["code"] for r in rows if "code" in r}
    if codes:
        runs = ", ".join(f"{code} (run {run})" for run, code in sorted(codes.items()))
        parts[0] += f" Code measured: {next(iter(codes.values())) if len(codes) == 1 else runs}."
    for name in MODELS:
        measured = [r for r in rows if r.get("model", MODELS[-1]) == name]
        if not measured:
            continue
        shown = {}
        for r in measured:
            shown.setdefault((r["library"], r["how"]), r)

        def plain(r, how):  # plain PyTorch run ``how``, in the same run as ``r``: ratios never cross runs
            same = [p for p in measured if (p["library"], p["how"]) == ("plain", how)]
            return next((p for p in same if p.get("run", 1) == r.get("run", 1)), None)

        table = []
        for library, how in VARIANTS:
            r = shown.get((library, how))
            if r is None or "error" in r:
                table.append([library, how, r["error"] if r else "not measured", "—", "—", "—", "—"])
                continue
            eager = plain(r, "eager")
            diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], eager["losses"])) if eager else None
            table.append([
                library, how + (f" (run {r['run']})" if r.get("run", 1) > 1 else ""), harness.fmt(r, "ms"),
                harness.ratio(r, plain(r, _SAME_WAY.get(how, how))), harness.ratio(r, eager),
                f"{r['first_steps_s']:.1f} s", "—" if diff is None else f"{diff:.1e}",
            ])  # fmt: skip
        header = ["library", "how", "step", "/ plain, same way", "/ plain eager", "first 3 steps", "loss rel. diff"]
        parts += [f"### {name}", harness.markdown_table(header, table)]
    if any(r.get("run", 1) > 1 for r in rows):
        parts.insert(1, (
            "Rows marked (run 2) were measured by a second run on another machine of the same kind (`GPT_CUDA_ONLY`), "
            "which measured again the plain rows they are divided by; a ratio divides rows of one run."
        ))  # fmt: skip
    return "\n\n".join(parts)
