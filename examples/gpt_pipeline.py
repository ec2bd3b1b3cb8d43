"""The GPT-style example trained with pipeline parallelism, alone and with tensor or data parallel stages.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/gpt_pipeline.py   # 2 stages
    python -m torch.distributed.run --standalone --nproc-per-node 4 examples/gpt_pipeline.py   # all modes

The model is ``examples/gpt.py``'s GPT with ``LAYERS`` blocks, cut into stages: the first stage embeds the
tokens, the last applies the final layer norm and the LM head, and the blocks are shared out evenly. Each
stage is laid out on its own placement with ``Module.to_global``; ``sbp_torch.pipeline.Pipeline`` runs the
micro-batches (1F1B by default) and an unmodified AdamW steps every stage's parameters. Every mode checks on
every rank that its losses match single-process training of the same model to within 1e-5 relative.

* ``pp``: one stage per rank (2 stages on 2 ranks, 4 on 4);
* ``pp_tp`` (4 ranks): 2 stages on ranks [0, 1] and [2, 3], each Megatron-style tensor parallel inside with
  ``gpt.py``'s plan (the logits stay split over the vocabulary into a vocab-parallel cross entropy);
* ``pp_dp`` (4 ranks): 2 stages, each data parallel inside (every micro-batch split over the stage's ranks);
* ``pp_interleaved`` (2 ranks): 4 stages of one block, stage ``g`` on rank ``g mod 2``: interleaved virtual
  stages, whose schedule emerges from the 1F1B quotas over the 4 stages.

The GPT ties its LM head to its token embedding, which sit on the first and last stages. The last stage holds
a copy of the embedding as its head, and the pipeline keeps the two equal (``tied=``): the same value to
start with, and after every step both get the sum of their gradients, as one shared parameter would.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import sbp_torch as st
from sbp_torch.pipeline import Pipeline
from sbp_torch.sbp import broadcast, split

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpt.py beside this file, however it is run
import gpt  # noqa: E402

LAYERS, BATCH, MICRO_BATCHES = 4, 8, 4


class Embed(nn.Module):
    """The model's token and position embeddings."""

    def __init__(self, model: gpt.GPT):
        super().__init__()
        self.tokens, self.positions = model.tokens, model.positions
        self.register_buffer("steps", model.steps)

    def forward(self, idx):
        return self.tokens(idx) + self.positions(self.steps[: idx.shape[1]])


class Final(nn.Module):
    """The final layer norm and an LM head holding a copy of the (tied) token embedding."""

    def __init__(self, model: gpt.GPT):
        super().__init__()
        self.ln = model.ln
        self.head = nn.Linear(gpt.WIDTH, gpt.VOCAB, bias=False)
        self.head.weight = nn.Parameter(model.tokens.weight.detach().clone())

    def forward(self, x):
        return self.head(self.ln(x))


class Stage(nn.Module):
    """Some consecutive blocks, after the embedding on the first stage and before the head on the last."""

    def __init__(self, blocks, embed=None, final=None):
        super().__init__()
        self.embed, self.blocks, self.final = embed, nn.Sequential(*blocks), final

    def forward(self, x):
        x = self.blocks(self.embed(x) if self.embed is not None else x)
        return self.final(x) if self.final is not None else x


def cut(model: gpt.GPT, stages: int) -> list[Stage]:
    """``model`` as ``stages`` stages (sharing its modules, except the last stage's copy of the head)."""
    blocks = list(model.blocks)
    per = len(blocks) // stages
    return [
        Stage(
            blocks[s * per : (s + 1) * per], Embed(model) if s == 0 else None, Final(model) if s == stages - 1 else None
        )
        for s in range(stages)
    ]


def tied(stages: int) -> list[tuple[str, str]]:
    return [("0.embed.tokens.weight", f"{stages - 1}.final.head.weight")]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, gpt.VOCAB), targets.reshape(-1))


# gpt.py's tensor parallel plan, renamed to the stages' parameter names
STAGE_TENSOR_PARALLEL = {
    ("embed." if name.startswith("tokens") else "final." if name.startswith("head") else "") + name: sbp
    for name, sbp in gpt.TENSOR_PARALLEL.items()
}


def layouts(world: int) -> dict:
    """mode -> (stage rank lists, parameter plan inside a stage, batch SBP inside a stage)."""
    out = {"pp": ([[r] for r in range(world)], broadcast, broadcast)}
    if 2 * world <= LAYERS:
        out["pp_interleaved"] = ([[s % world] for s in range(2 * world)], broadcast, broadcast)
    if world == 4:
        out["pp_tp"] = ([[0, 1], [2, 3]], STAGE_TENSOR_PARALLEL, broadcast)
        out["pp_dp"] = ([[0, 1], [2, 3]], broadcast, split(0))
    return out


def run(mode: str, steps: int, schedule: str = "1f1b", backend=None) -> tuple[list[float], list[float], float]:
    """(single-process losses, pipelined losses, largest difference between the tied copies), on every rank;
    ``backend`` compiles each stage's forward (and so its backward) with ``torch.compile``."""
    torch.manual_seed(0)
    reference = gpt.GPT(LAYERS)
    model = copy.deepcopy(reference)
    want = gpt.train(reference, steps, batch=BATCH)
    ranks, plan, batch_sbp = layouts(dist.get_world_size())[mode]
    stages = [stage.to_global(st.placement("cpu", group), plan) for stage, group in zip(cut(model, len(ranks)), ranks)]
    if backend is not None:
        for stage in stages:
            stage.forward = torch.compile(stage.forward, backend=backend, fullgraph=True, dynamic=False)
    pipe = Pipeline(
        stages, loss_fn, MICRO_BATCHES, schedule, input_sbp=batch_sbp, target_sbp=batch_sbp, tied=tied(len(stages))
    )
    optimizer = gpt.make_optimizer(nn.ModuleList(stages))
    got = []
    for idx, targets in gpt.batches(steps, BATCH):
        optimizer.zero_grad()
        got.append(pipe.step(idx, targets))
        optimizer.step()
    return want, got, tied_drift(stages)


def tied_drift(stages: list[Stage]) -> float:
    """Largest difference between the embedding and the last stage's copy of it, on every rank."""
    embedding, head = stages[0].embed.tokens.weight, stages[-1].final.head.weight
    moved = head.detach().to_global(embedding.placement, embedding.sbp)
    drift = torch.zeros((), dtype=torch.float64)
    if dist.get_rank() in embedding.placement:
        drift += (moved.full_tensor() - embedding.detach().full_tensor()).abs().max()
    dist.all_reduce(drift, op=dist.ReduceOp.MAX)
    return float(drift)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mode", choices=["pp", "pp_tp", "pp_dp", "pp_interleaved", "all"], default="all")
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument(
        "--compile", nargs="?", const="inductor", choices=["inductor", "aot_eager"], help="compile every stage"
    )
    args = parser.parse_args()
    dist.init_process_group("gloo")
    modes = layouts(dist.get_world_size())
    for mode in modes if args.mode == "all" else [args.mode]:
        want, got, drift = run(mode, args.steps, args.schedule, args.compile)
        worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
        if dist.get_rank() == 0:
            stages = len(modes[mode][0])
            print(
                f"{mode:14} {stages} stages, {args.schedule}: losses {want[0]:.5f} -> {want[-1]:.5f} in "
                f"{args.steps} steps; largest relative difference from one process: {worst:.1e}; "
                f"tied copies differ by {drift:.1e}",
                flush=True,
            )
        assert worst < 1e-5, f"{mode}: losses differ from single-process training by {worst:.1e}"
        assert drift == 0.0, f"{mode}: the tied embedding and head copies drifted apart by {drift:.1e}"
    if dist.get_rank() == 0:
        print("all modes match single-process training", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
