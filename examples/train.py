"""Train an unmodified ``transformers`` causal LM on several ranks with a planned layout, and check it against one
process.

    python -m torch.distributed.run --standalone --nproc-per-node 4 examples/train.py
        [--model qwen2 | gpt_neox | opt | mixtral | qwen3_moe | DIR] [--layout plan | dp | sharded | tp | 2d]
        [--steps 20] [--batch-size 8] [--seq-len 16] [--grad-accum-steps 1]
        [--lr 3e-3] [--warmup-steps 2] [--decay cosine | linear | constant] [--weight-decay 0.1] [--max-norm 1.0]
        [--measure K] [--memory-limit 512MiB] [--eager | --backend eager | aot_eager | inductor]
        [--data FILE [--tokenizer DIR]]
        [--checkpoint-dir DIR [--checkpoint-every 10] [--keep-checkpoints K] [--resume [STEP]]]
        [--check auto | on | off] [--metrics FILE.jsonl] [--plot FILE.png] [--config FILE.toml]

(``python examples/train.py`` runs it as one rank.) What it does, in order (docs/train.md walks through each step):

1. **Model.** ``--model`` names a tiny configuration of the zoo (``zoo/dense.py``, ``zoo/moe.py``: random weights,
   nothing downloaded, dropout off; ``qwen2``, a Llama-style decoder, by default) or a local folder that
   ``transformers.AutoModelForCausalLM.from_pretrained`` reads. Every rank builds the same model from ``--seed``.
2. **Batches.** Random token ids by default (there is nothing to learn in them: the loss stays near ln(vocabulary));
   with ``--data FILE``, windows of the file's tokens (``--tokenizer DIR``'s, else its bytes, the model's
   vocabulary grown to 256 where it is smaller). Step ``k``'s batch is a function of ``k`` and ``--seed`` alone, the
   same on every rank, so a resumed run sees the data an uninterrupted one saw.
3. **Layout.** ``plan`` (the default): ``sbp_torch.planner.plan`` picks the mesh, the tensor-parallel splits and the
   sharding under ``--memory-limit`` (docs/planning.md); rank 0 plans before the process group starts and sends the
   plan to the others. With ``--measure K`` every rank plans inside the group, and the ``K`` layouts predicted
   fastest are timed for a few real steps; the fastest measured is taken (the prediction leaves out what an eager
   step pays in Python and what ranks sharing cores cost each other). Or a layout written by hand, on the ranks of
   the job: ``dp`` (parameters broadcast, batch split by rows), ``sharded`` (``dp`` with every parameter stored
   split, as FSDP2 and ZeRO do), ``tp`` (the model's Megatron-style plan from the zoo, batch broadcast; a mixture-
   of-experts model's experts split by expert) and ``2d`` (data parallel over the rows of a grid of 2 columns,
   tensor parallel within each row). ``model.to_global`` lays the model out (docs/training.md).
4. **Step.** AdamW with linear warmup then ``--decay``, gradients accumulated over ``--grad-accum-steps``
   micro-batches and clipped to ``--max-norm``. The whole step (the batch's layout, forwards, backwards, clipping,
   AdamW) is one program of this rank's local ops and collectives, traced by ``sbp_torch.compile_step``
   (docs/compile.md) on its second call, its first running eagerly; ``--eager`` runs every step op by op through
   sbp_torch's dispatcher instead. ``--backend`` is the ``torch.compile`` backend the program is handed to:
   ``eager`` (the default) runs it as traced, ``aot_eager`` and ``inductor`` compile it further. The default is
   the one that keeps the first command under a minute: on 4 CPU ranks sharing 2 cores, the default model's
   program traced in 7 s with ``eager`` and 11 s with ``aot_eager``, and Inductor's cold compile took 129 s; the
   traced program's steps take about 25 ms (on a model this small a step is Python and collectives).
5. **Checkpoints.** With ``--checkpoint-dir``, the model, AdamW's state, the schedule and the losses so far are saved
   every ``--checkpoint-every`` steps to ``DIR/step-N`` through ``sbp_torch.checkpoint`` (docs/checkpoint.md), and a
   plan to ``DIR/plan.json``. ``--resume`` continues from the last checkpoint (``--resume N``: from ``step-N``),
   with the saved plan, and trains on to the losses of an uninterrupted run bit for bit.

It prints, on rank 0: the layout, what one micro-batch's forward and backward send (``sbp_torch.explain``), the
memory a rank holds after the first step (``sbp_torch.memory_report``), then per step the loss, learning rate, tokens
per second and step time (a progress bar on a terminal, a line per step elsewhere). At the end it trains the same
model on the same batches in one process, plain PyTorch, and compares the losses (``--check auto``: where the model
has at most 10 million parameters and no dropout, whose random streams differ between one process and several
ranks). It exits with an error where a step's loss differs by more than 1e-5 relative: float32 sums run in another
order on each layout, which moves a loss by an ulp or two (the zoo's models stayed within 2.3e-7 over 20 steps).
``--metrics`` appends each step as a line of JSON to a file; ``--plot`` draws the losses (needs matplotlib:
``pip install -e ".[bench]"``).

Options come from the command line, or from a TOML or JSON file (``--config``) whose keys are their long names
(``batch-size`` or ``batch_size``; tables only group them); the command line wins.

The model's configuration is kept as it is, ``use_cache`` included: with it off, ``transformers`` reads the
position ids to look for packed sequences, a branch on a tensor that a compiled step refuses (a plan's trace follows
those values, docs/planning.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import sbp_torch as st
from sbp_torch import planner
from sbp_torch.sbp import Broadcast, broadcast, split

# The zoo's tiny models live at the repository root, beside this folder (the tests train the same ones).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from zoo import dense, moe  # noqa: E402

CHECK_LIMIT = 10_000_000  # parameters: up to here, --check auto trains the model in one process too
TOLERANCE = 1e-5  # the largest relative difference of a step's loss from one process's


# ---------------------------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class CausalLM:
    """A causal LM the job can build: ``make()`` builds it from the current seed; ``tensor_parallel(axis_sbp)`` is its
    Megatron-style plan, ``axis_sbp(s)`` turning the tensor axis' SBP into the whole SBP (None: no plan known)."""

    make: Callable[[], torch.nn.Module]
    tensor_parallel: Callable[[Callable], dict] | None


def _zoo_models() -> dict[str, CausalLM]:
    dense_models = {m.name: CausalLM(m.make, m.tp_plan) for m in dense.ZOO if m.name in ("qwen2", "gpt_neox", "opt")}
    # The experts run transformers' default code (grouped_mm: one grouped matmul); its "eager" code loops in Python
    # over the experts that received tokens, which a compiled step cannot hold.
    moe_models = {
        name: CausalLM(lambda name=name: moe.MODELS[name]("grouped_mm"), moe.tensor_parallel)
        for name in ("mixtral", "qwen3_moe")
    }
    return dense_models | moe_models


MODELS = _zoo_models()


# Model types whose layers carry Qwen2's names (q_proj ... down_proj), so that its tensor-parallel plan fits them
QWEN2_NAMES = ("llama", "mistral", "qwen2")


def gpt2_tensor_parallel(axis_sbp: Callable) -> dict:
    """GPT-2's Megatron-style plan. Its linears are ``Conv1D``, whose weight is (input, output): column-parallel
    splits the weight's dim 1, row-parallel its dim 0. (``c_attn`` holds q, k and v side by side: split as one
    weight, each rank's columns are not whole heads of each, which the dispatcher mends by an exchange per block.)"""
    plan = {}
    for layer in ("attn.c_attn", "mlp.c_fc"):
        plan[f"*.{layer}.weight"], plan[f"*.{layer}.bias"] = axis_sbp(split(1)), axis_sbp(split(0))
    for layer in ("attn.c_proj", "mlp.c_proj"):
        plan[f"*.{layer}.weight"] = axis_sbp(split(0))
    return plan


PLANS_BY_TYPE = {"gpt2": gpt2_tensor_parallel}  # tensor-parallel plans of model types outside the zoo


def causal_lm(name: str) -> CausalLM:
    """The zoo's tiny model ``name``, or the model saved in the folder ``name`` (with the tensor-parallel plan of its
    model type, where the zoo or ``PLANS_BY_TYPE`` has one)."""
    if name in MODELS:
        return MODELS[name]
    if not os.path.isdir(name):
        raise SystemExit(f"--model {name!r}: neither one of {', '.join(MODELS)} nor a folder")
    import transformers

    if int(os.environ.get("RANK", 0)) != 0:
        transformers.utils.logging.disable_progress_bar()  # (one bar of loading weights, rank 0's, is enough)
    kind = transformers.AutoConfig.from_pretrained(name).model_type
    zoo_model = MODELS.get("qwen2" if kind in QWEN2_NAMES else kind)
    return CausalLM(
        lambda: transformers.AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32),
        zoo_model.tensor_parallel if zoo_model else PLANS_BY_TYPE.get(kind),
    )


def build(spec: CausalLM, seed: int, vocabulary: int | None) -> torch.nn.Module:
    """The model in float32 and training mode, its random weights drawn from ``seed``; its embeddings grown to
    ``vocabulary`` tokens where they hold fewer."""
    torch.manual_seed(seed)
    model = spec.make().float().train()
    if vocabulary is not None and model.get_input_embeddings().num_embeddings < vocabulary:
        model.resize_token_embeddings(vocabulary, mean_resizing=False)
    return model


def dropout(model: torch.nn.Module) -> list[str]:
    """The modules that drop out in training: ``nn.Dropout`` with a probability above 0, and attention modules whose
    ``attention_dropout`` (what ``transformers``' attention functions take as their probability) is above 0."""
    found = []
    for name, module in model.named_modules():
        attention = getattr(module, "attention_dropout", None)
        if isinstance(module, torch.nn.Dropout) and module.p > 0 or isinstance(attention, float) and attention > 0:
            found.append(name)
    return found


# ---------------------------------------------------------------------------------------------------- batches


class RandomTokens:
    """Token ids drawn uniformly from the vocabulary."""

    def __init__(self, vocabulary: int, rows: int, length: int, seed: int):
        self.vocabulary, self.rows, self.length, self.seed = vocabulary, rows, length, seed

    def batch(self, index: int) -> torch.Tensor:
        """Micro-batch ``index``: (rows, length) token ids, a function of ``index`` and the seed alone."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randint(self.vocabulary, (self.rows, self.length), generator=generator)


class TextFile:
    """Windows of a text file's tokens at random offsets: a tokenizer's tokens, or the file's bytes."""

    def __init__(self, path: str, tokenizer: str | None, rows: int, length: int, seed: int):
        with open(path, "rb") as f:
            data = f.read()
        if tokenizer is None:
            self.tokens, self.vocabulary = torch.tensor(list(data), dtype=torch.long), 256
        else:
            import transformers

            tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
            self.tokens = torch.tensor(tok(data.decode("utf-8"))["input_ids"], dtype=torch.long)
            self.vocabulary = len(tok)
        if len(self.tokens) <= length:
            raise SystemExit(f"--data {path}: {len(self.tokens)} tokens, not more than --seq-len {length}")
        self.rows, self.length, self.seed = rows, length, seed

    def batch(self, index: int) -> torch.Tensor:
        """Micro-batch ``index``: (rows, length) token ids, a function of ``index`` and the seed alone."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        starts = torch.randint(len(self.tokens) - self.length, (self.rows,), generator=generator)
        return torch.stack([self.tokens[s : s + self.length] for s in starts.tolist()])


def model_and_batches(args) -> tuple[torch.nn.Module, RandomTokens | TextFile]:
    """The model ``args.model`` and the source of its batches (text needs its vocabulary; random tokens the model's)."""
    if args.data:
        text = TextFile(args.data, args.tokenizer, args.batch_size, args.seq_len, args.seed)
        return build(causal_lm(args.model), args.seed, text.vocabulary), text
    model = build(causal_lm(args.model), args.seed, None)
    vocabulary = model.get_input_embeddings().num_embeddings
    return model, RandomTokens(vocabulary, args.batch_size, args.seq_len, args.seed)


def step_batches(source, step: int, accumulate: int) -> torch.Tensor:
    """The micro-batches of optimizer step ``step`` (from 0), stacked: (accumulate, rows, length)."""
    return torch.stack([source.batch(step * accumulate + i) for i in range(accumulate)])


# ---------------------------------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """How the model and the batch are laid out: ``apply(model)`` lays the model out in place; ``batch_sbp`` is the
    SBP of a batch of token ids; ``plan`` the planner's plan, for ``--layout plan``."""

    name: str
    placement: st.placement
    apply: Callable[[torch.nn.Module], object]
    batch_sbp: tuple
    plan: planner.Plan | None = None

    def lay_out(self, ids: torch.Tensor) -> torch.Tensor:
        """The whole batch ``ids``, the same on every rank, as a global tensor of which each rank keeps its part."""
        everywhere = (broadcast,) * self.placement.ndim
        # check_meta=False: every rank holds the same whole batch (the sources are seeded), so nothing is compared
        return ids.to_global(self.placement, everywhere, check_meta=False).to_global(sbp=self.batch_sbp)


def hand_layout(name: str, spec: CausalLM, world: int) -> Layout:
    """The layout ``name`` (dp, sharded, tp or 2d) on ``world`` ranks."""
    line = st.placement("cpu", list(range(world)))
    if name == "dp":
        return Layout(name, line, lambda m: m.to_global(line), (split(0),))
    if name == "sharded":
        return Layout(name, line, lambda m: m.to_global(line, shard=0), (split(0),))
    if spec.tensor_parallel is None:
        raise SystemExit(f"--layout {name}: no tensor-parallel plan is known for this model; try plan, dp or sharded")
    if name == "tp":
        return Layout(name, line, lambda m: m.to_global(line, spec.tensor_parallel(lambda s: s)), (broadcast,))
    if world % 2:
        raise SystemExit(f"--layout 2d: a grid of 2 columns needs an even number of ranks, not {world}")
    grid = st.placement("cpu", [[row, row + 1] for row in range(0, world, 2)])
    plan = spec.tensor_parallel(lambda s: (broadcast, s))
    return Layout(name, grid, lambda m: m.to_global(grid, plan), (split(0), broadcast))


def planned_layout(plan: planner.Plan, ids: torch.Tensor) -> Layout:
    """The layout ``plan`` gives the model and batches of token ids like ``ids``."""
    return Layout("plan", plan.placement(), lambda m: m.to_global(plan), plan.batch_sbp(ids), plan)


def make_plan(args, model, source, world: int) -> planner.Plan:
    """The plan of ``--plan FILE``; else the one a resumed run saved in its checkpoint directory; else a new one,
    saved there where there is one."""
    if args.plan:
        return planner.Plan.load(args.plan)
    saved = os.path.join(args.checkpoint_dir, "plan.json") if args.checkpoint_dir else None
    if saved and args.resume and os.path.exists(saved):
        return planner.Plan.load(saved)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"planning {type(model).__name__} for {world} ranks ...", flush=True)
    ids = source.batch(0)
    batch = {"input_ids": ids, "labels": ids}
    # The eager step is priced even for a compiled one: plan(compiled=True) takes a program's host time per op as
    # nil, as it is for Inductor's fused kernels, but this job's default backend runs each op of the program in Python.
    plan = planner.plan(model, batch, world, memory_per_rank=args.memory_limit, measure=args.measure)
    if saved and (not dist.is_initialized() or dist.get_rank() == 0):
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        plan.save(saved)
    return plan


def describe(layout: Layout, model: torch.nn.Module) -> str:
    """The plan's table; for a layout written by hand, its mesh, its batch and the parameters it splits."""
    if layout.plan is not None:
        return str(layout.plan)
    lines = [f"layout {layout.name}: mesh {list(layout.placement.shape)}, batch {layout.batch_sbp}"]
    if layout.name == "sharded":
        lines.append("  every parameter broadcast, stored split over axis 0 and gathered by block while it runs")
        return "\n".join(lines)
    split_ones = [(n, p.sbp) for n, p in model.named_parameters() if not all(isinstance(s, Broadcast) for s in p.sbp)]
    lines += [f"  {name:56} {sbp}" for name, sbp in split_ones]
    lines.append("  every other parameter: broadcast")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- the step


def make_optimizer(model, args) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW, and its schedule: linear warmup over ``warmup_steps`` (from 1 / (warmup + 1) of the rate, as
    torchtitan's), then ``decay`` towards 0 at the last step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    warmup, total = args.warmup_steps, args.steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        if args.decay == "linear":
            return 1 - progress
        if args.decay == "cosine":
            return 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_step(model, optimizer, lay_out: Callable, max_norm: float) -> Callable:
    """One optimizer step on (accumulate, rows, length) micro-batches; returns their mean loss."""

    def step(micro_batches: torch.Tensor) -> torch.Tensor:
        losses = []
        for ids in micro_batches.unbind(0):
            ids = lay_out(ids)
            loss = model(input_ids=ids, labels=ids).loss / len(micro_batches)
            loss.backward()
            losses.append(loss.detach())
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return sum(losses)

    return step


# ---------------------------------------------------------------------------------------------------- checkpoints


def saved_steps(directory: str) -> list[int]:
    """The steps of the checkpoints published under ``directory`` (``step-N``), in order."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(m[1]) for name in os.listdir(directory) if (m := re.fullmatch(r"step-(\d+)", name)))


def resume_path(args) -> str | None:
    """The checkpoint to resume from: ``--resume``'s step, or the last one; None for a fresh run."""
    if not args.resume or not args.checkpoint_dir:
        return None
    steps = saved_steps(args.checkpoint_dir)
    if args.resume != "latest" and int(args.resume) not in steps:
        raise SystemExit(f"--resume {args.resume}: {args.checkpoint_dir} holds the steps {steps}")
    if not steps:
        return None
    return os.path.join(args.checkpoint_dir, f"step-{steps[-1] if args.resume == 'latest' else int(args.resume)}")


def remove_old_checkpoints(directory: str, keep: int) -> None:
    """Keep the last ``keep`` checkpoints (0: all). Each is a link to the directory its save published."""
    for step in saved_steps(directory)[:-keep] if keep else []:
        link = os.path.join(directory, f"step-{step}")
        target = os.path.realpath(link)
        os.remove(link)
        shutil.rmtree(target, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- output


class Progress:
    """Per step, on rank 0: a bar redrawn in place on a terminal, a line per step elsewhere (a log file, CI)."""

    def __init__(self, total: int, shown: bool, out=sys.stdout):
        self.total, self.shown, self.out = total, shown, out
        self.live = shown and out.isatty()
        self.drawn = False

    def step(self, step: int, loss: float, lr: float, tokens_per_s: float, step_s: float) -> None:
        if not self.shown:
            return
        text = f"loss {loss:.5f}  lr {lr:.2e}  {tokens_per_s:,.0f} tokens/s  {step_s * 1e3:.1f} ms"
        counter = f"step {step:>{len(str(self.total))}}/{self.total}"
        if self.live:
            done = round(24 * step / self.total)
            self.out.write(f"\r{counter} [{'#' * done}{'.' * (24 - done)}] {text}\x1b[K")
            self.drawn = True
        else:
            self.out.write(f"{counter}  {text}\n")
        self.out.flush()

    def note(self, text: str) -> None:
        """``text`` on lines of its own (above the bar, on a terminal)."""
        if not self.shown:
            return
        if self.drawn:
            self.out.write("\r\x1b[K")
            self.drawn = False
        print(text, file=self.out, flush=True)

    def close(self) -> None:
        if self.drawn:
            self.out.write("\n")
            self.out.flush()


def explain_summary(explanation: st.Explanation) -> str:
    """The first line of ``explanation``, then its collectives by phase and kind: how many, and their bytes."""
    rows: dict[tuple[str, str], list[int]] = {}
    for c in explanation:
        row = rows.setdefault(("backward" if c.backward else "forward", c.kind), [0, 0])
        row[0] += 1
        row[1] += c.bytes or 0
    lines = [str(explanation).splitlines()[0]]
    lines += [f"  {phase:8} {kind:22} x{n:<4} {nbytes:>12,} B" for (phase, kind), (n, nbytes) in rows.items()]
    return "\n".join(lines)


def plot(path: str, losses: list[float], reference: list[float] | None, ranks: int) -> None:
    import matplotlib

    matplotlib.use("Agg")  # (no display)
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    steps = range(1, len(losses) + 1)
    axes.plot(steps, losses, label=f"{ranks} ranks")
    if reference:
        axes.plot(steps, reference, "--", label="one process")
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


# ---------------------------------------------------------------------------------------------------- options


def parse_bytes(text: str) -> float:
    """``512MiB``, ``1.5GB``, ``4e8``: a number of bytes."""
    match = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]i?B|B)?\s*", str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not an amount of memory (512MiB, 1.5GB, 4e8)")
    unit = match[2] or "B"
    return float(match[1]) * (1024 if "i" in unit else 1000) ** "BKMGT".index(unit[0])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--config", help="a TOML or JSON file of options by their long names; the command line wins")
    add("--model", default="qwen2", help=f"one of {', '.join(MODELS)}, or a local model folder (default: qwen2)")
    add("--layout", default="plan", choices=["plan", "dp", "sharded", "tp", "2d"], help="default: plan")
    add("--steps", type=int, default=20, help="optimizer steps (default: 20)")
    add("--batch-size", type=int, default=8, help="rows of each micro-batch, over all ranks (default: 8)")
    add("--seq-len", type=int, default=16, help="tokens per row (default: 16)")
    add("--grad-accum-steps", type=int, default=1, help="micro-batches per optimizer step (default: 1)")
    add("--lr", type=float, default=3e-3, help="AdamW's peak learning rate (default: 3e-3)")
    add("--warmup-steps", type=int, default=2, help="(default: 2)")
    add("--decay", default="cosine", choices=["cosine", "linear", "constant"], help="after warmup (default: cosine)")
    add("--weight-decay", type=float, default=0.1, help="(default: 0.1)")
    add("--max-norm", type=float, default=1.0, help="clip the gradients' norm to this; 0: no clipping (default: 1)")
    add("--plan", help="for --layout plan: the plan saved in this file (Plan.save), rather than a new one")
    add(
        "--measure",
        type=int,
        default=0,
        metavar="K",
        help="for --layout plan: every rank times the K layouts predicted fastest and takes the fastest measured",
    )
    add("--memory-limit", type=parse_bytes, help="per rank (512MiB, 2GB): the plan's; checked after step 1 by hand")
    add("--eager", action="store_true", help="run each step op by op instead of as one program")
    add("--backend", default="eager", help="torch.compile backend of the step's program: eager, aot_eager, inductor")
    add("--data", help="a text file to train on (default: random tokens)")
    add("--tokenizer", help="a local tokenizer folder for --data (default: the file's bytes)")
    add("--seed", type=int, default=0, help="of the weights and the batches (default: 0)")
    add("--checkpoint-dir", help="save checkpoints here, as DIR/step-N")
    add("--checkpoint-every", type=int, default=10, help="steps (default: 10)")
    add("--keep-checkpoints", type=int, default=0, help="keep the last K checkpoints; 0: all (default)")
    add("--resume", nargs="?", const="latest", help="continue from the last checkpoint, or from step-N")
    add("--check", default="auto", choices=["auto", "on", "off"], help="compare the losses with one process")
    add("--metrics", help="append each step to this file as a line of JSON")
    add("--plot", help="draw the losses into this PNG file (needs matplotlib)")
    given, _ = parser.parse_known_args(argv)
    if given.config:
        parser.set_defaults(**read_config(given.config, parser))
    args = parser.parse_args(argv)
    if args.plan and args.layout != "plan":
        parser.error(f"--plan is the layout of --layout plan, not of --layout {args.layout}")
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume continues from a checkpoint of --checkpoint-dir DIR: name the directory")
    if args.resume not in (None, "latest") and not str(args.resume).isdigit():
        parser.error(f"--resume takes a step number (the N of DIR/step-N), not {args.resume!r}")
    if args.checkpoint_dir and not args.resume and saved_steps(args.checkpoint_dir):
        # (a fresh run would write its plan beside them, and a later --resume would mix the two runs)
        steps = saved_steps(args.checkpoint_dir)
        parser.error(
            f"{args.checkpoint_dir} holds the checkpoints of an earlier run (steps {steps}): --resume continues it; "
            "a fresh run needs another directory"
        )
    if args.measure and args.layout != "plan":
        parser.error(f"--measure times the planner's candidates: it needs --layout plan, not --layout {args.layout}")
    return args


def read_config(path: str, parser: argparse.ArgumentParser) -> dict:
    """The options in a TOML or JSON file, by their destinations; tables are flattened."""
    with open(path, "rb") as f:
        if path.endswith(".json"):
            data = json.load(f)
        else:
            import tomllib  # (Python 3.11 and later)

            data = tomllib.load(f)
    flat, tables = {}, [data]
    while tables:
        for key, value in tables.pop().items():
            if isinstance(value, dict):
                tables.append(value)
            else:
                flat[key.replace("-", "_")] = value
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    unknown = sorted(set(flat) - set(actions))
    if unknown:
        raise SystemExit(f"{path}: unknown options {', '.join(unknown)}")
    return {k: actions[k].type(v) if actions[k].type and isinstance(v, str) else v for k, v in flat.items()}


# ---------------------------------------------------------------------------------------------------- the job


@dataclass
class Result:
    """What a run leaves, the same on every rank."""

    losses: list[float]  # every step's, those before the checkpoint a run resumed from included
    reference: list[float] | None  # one process's, where compared
    worst: float | None  # the largest relative difference between the two
    step_seconds: list[float]  # of the steps this run trained


def run(args, prepared: tuple | None = None, plan: planner.Plan | None = None) -> Result:
    """Train as ``args`` say, in the default process group, printing on rank 0 as it goes.

    ``prepared``: ``model_and_batches(args)``, where made already; ``plan``: the layout of ``--layout plan``, where
    made already (else every rank plans here, and all take rank 0's plan)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else lambda *a, **k: None
    model, source = prepared or model_and_batches(args)
    if args.layout == "plan":
        plan = plan or make_plan(args, model, source, world)
        if plan.world_size != world:
            raise SystemExit(f"the plan is for {plan.world_size} ranks, and the job has {world}")
        layout = planned_layout(plan, source.batch(0))
    else:
        layout = hand_layout(args.layout, causal_lm(args.model), world)
    layout.apply(model)
    say(describe(layout, model), flush=True)

    optimizer, schedule = make_optimizer(model, args)
    step_fn = make_step(model, optimizer, layout.lay_out, args.max_norm)
    explanation = st.explain(
        lambda ids: model(input_ids=layout.lay_out(ids), labels=layout.lay_out(ids)).loss, source.batch(0)
    )
    say("\nwhat one micro-batch's forward and backward send, on rank 0:\n" + explain_summary(explanation), flush=True)
    if not args.eager:
        step_fn = st.compile_step(step_fn, model=model, optimizer=optimizer, backend=args.backend)

    state = {"model": model, "optim": optimizer, "schedule": schedule, "losses": []}
    resume_from = resume_path(args)
    if resume_from:
        if not args.eager:
            # compile_step runs its first call eagerly and traces from the second: make that call here (on a batch
            # of the same shape), then load the checkpoint over all it changed, so that every step from here on runs
            # the program an uninterrupted run ran, to its bits
            step_fn(step_batches(source, 0, args.grad_accum_steps))
        st.checkpoint.load(state, resume_from)
        say(f"\nresumed from {resume_from} after step {len(state['losses'])}", flush=True)
    losses = state["losses"]

    tokens = args.batch_size * args.seq_len * args.grad_accum_steps
    how = "eager, op by op" if args.eager else f"one program by compile_step, backend {args.backend}"
    say(f"\ntraining {args.steps} steps of {tokens} tokens ({how})", flush=True)
    progress = Progress(args.steps, shown=rank == 0)
    metrics = open(args.metrics, "a") if args.metrics and rank == 0 else None  # noqa: SIM115 (closed below)
    seconds = []
    for step in range(len(losses), args.steps):
        started = time.perf_counter()
        lr = schedule.get_last_lr()[0]
        loss = step_fn(step_batches(source, step, args.grad_accum_steps)).item()
        schedule.step()
        seconds.append(time.perf_counter() - started)
        losses.append(loss)
        progress.step(step + 1, loss, lr, tokens / seconds[-1], seconds[-1])
        if metrics:
            record = dict(step=step + 1, loss=loss, lr=lr, tokens_per_s=tokens / seconds[-1], step_s=seconds[-1])
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        if len(seconds) == 1:
            report = st.memory_report(model, optimizer)
            progress.note(f"memory on rank 0 after its first step:\n{report}")
            check_memory(report, args.memory_limit, layout)
        if args.checkpoint_dir and (step + 1) % args.checkpoint_every == 0:
            st.checkpoint.save(state, os.path.join(args.checkpoint_dir, f"step-{step + 1}"))
            if rank == 0:
                remove_old_checkpoints(args.checkpoint_dir, args.keep_checkpoints)
    progress.close()
    if metrics:
        metrics.close()
    if len(seconds) > 2:
        steady = sum(seconds[2:]) / len(seconds[2:])
        say(f"steps after the first two: {steady * 1e3:.1f} ms, {tokens / steady:,.0f} tokens/s", flush=True)

    reference = compare_with_one_process(args, model, source, losses)
    worst = None if reference is None else largest_relative_difference(losses, reference)
    if rank == 0 and args.plot:
        plot(args.plot, losses, reference, world)
        say(f"loss plot: {args.plot}", flush=True)
    return Result(losses, reference, worst, seconds)


def check_memory(report: st.MemoryReport, limit: float | None, layout: Layout) -> None:
    """Every rank stops where one holds more than ``limit`` bytes of parameters, gradients, optimizer state and
    gathered copies after its first step. (A plan was made to fit the limit, activations included.)"""
    if limit is None or layout.plan is not None:
        return
    held = report.parameters + report.gradients + report.optimizer_state + (report.gathered_peak or 0)
    most = torch.tensor([float(held)], dtype=torch.float64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    if most.item() > limit:
        raise SystemExit(
            f"--memory-limit {limit:,.0f} B: a rank holds {most.item():,.0f} B after the first step in layout "
            f"{layout.name}; --layout sharded or plan may fit"
        )


def largest_relative_difference(losses: list[float], reference: list[float]) -> float:
    return max(abs(got - want) / abs(want) for got, want in zip(losses, reference))


def compare_with_one_process(args, model: torch.nn.Module, source, losses: list[float]) -> list[float] | None:
    """One process's losses, trained by rank 0 in plain PyTorch on a model built as ``model`` was and on the same
    batches; None where not compared (``--check``, the model's size, its dropout). Every rank gets rank 0's answer."""
    parameters = sum(p.numel() for p in model.parameters())  # (logical sizes)
    why_not = None
    if args.check == "off":
        why_not = "--check off"
    elif args.check == "auto" and parameters > CHECK_LIMIT:
        why_not = f"{parameters:,} parameters, more than {CHECK_LIMIT:,} (--check on compares them)"
    elif dropping := dropout(model):
        why_not = f"it drops out ({', '.join(dropping[:3])}, ...), and the random streams differ"
    reference = None
    if why_not and dist.get_rank() == 0:
        print(f"not compared with one process: {why_not}", flush=True)
    elif dist.get_rank() == 0:
        one = build(causal_lm(args.model), args.seed, source.vocabulary)
        optimizer, schedule = make_optimizer(one, args)
        step = make_step(one, optimizer, lambda ids: ids, args.max_norm)
        reference = []
        for index in range(args.steps):
            reference.append(step(step_batches(source, index, args.grad_accum_steps)).item())
            schedule.step()
        worst = largest_relative_difference(losses, reference)
        print(f"\nlosses {losses[0]:.5f} -> {losses[-1]:.5f}; one process: {reference[0]:.5f} -> {reference[-1]:.5f}")
        verdict = "matches one process" if worst <= TOLERANCE else "DIFFERS from one process"
        print(f"{verdict}: the largest relative difference over {args.steps} steps is {worst:.1e}", flush=True)
    shared = [reference]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" not in os.environ:  # run as a plain script, not by torchrun: a world of one rank
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.plot:
        import matplotlib  # noqa: F401  (missing, it stops the job before training rather than after)
    prepared = model_and_batches(args)
    plan_json = None
    if args.layout == "plan" and not args.measure and int(os.environ.get("RANK", 0)) == 0:
        # Rank 0 plans before the process group starts: the planner needs none, and one process planning is faster
        # than every rank planning on cores they share. (Where it fails, torchrun stops the other ranks.)
        world = int(os.environ.get("WORLD_SIZE", 1))
        try:
            plan_json = make_plan(args, *prepared, world).to_json()
        except planner.PlanError as err:
            raise SystemExit(f"--layout plan: {err}") from None
    st.init_process_group("gloo")  # as torch.distributed's, and a job torchrun restarts rendezvouses afresh
    try:
        plan = None
        if args.layout == "plan" and args.measure:  # (timing real steps takes every rank)
            plan = make_plan(args, *prepared, dist.get_world_size())
        elif args.layout == "plan":
            shared = [plan_json]
            dist.broadcast_object_list(shared, src=0)
            plan = planner.Plan.from_json(shared[0])
        result = run(args, prepared, plan)
    finally:
        dist.destroy_process_group()
    if result.worst is not None and result.worst > TOLERANCE:
        raise SystemExit(f"the losses differ from one process by {result.worst:.1e} relative, more than {TOLERANCE:g}")


if __name__ == "__main__":
    main()
