"""A GPT-style transformer trained with data, tensor (Megatron-style) and hybrid parallelism on CPU ranks.

    python -m torch.distributed.run --standalone --nproc-per-node 4 examples/gpt.py [--steps 20] [--mode all]
        [--compile [inductor|aot_eager]] [--compile-step [inductor|aot_eager|eager]]
        [--checkpoint-dir DIR [--checkpoint-every 5] [--resume]]

The model is plain PyTorch (nothing in it knows about sbp_torch). Parallelism is a plan: which SBP each
parameter gets, and how the batch is laid out. Every mode trains a copy of the same model for ``--steps``
steps of AdamW and checks, on every rank, that its losses match single-process training of the same model
on the same batches to within 1e-5 relative.

* ``dp``: every parameter broadcast, the batch split on the 4 ranks (gradients all-reduced, bucketed);
* ``tp``: Megatron-style on the 4 ranks: q/k/v and the first MLP linear split by output features
  (column parallel), the attention output and second MLP linear split by input features (row parallel, a
  partial sum reduced before the next layer norm), heads split, the embedding split over the vocabulary and
  tied to the LM head, so the logits stay split over the vocabulary into a vocab-parallel cross entropy;
* ``dp_tp``: both on a 2x2 mesh: batch split along axis 0, the tensor-parallel plan along axis 1.

With ``--compile``, the global model's forward and backward (``fullgraph=True``, gradient reduction included)
and the optimizer step run through ``torch.compile``; the single-process reference stays eager. With
``--compile-step``, each training step (batch layout, forward, backward, AdamW) is one program compiled by
``sbp_torch.compile_step`` (docs/compile.md, "Whole training steps").

With ``--checkpoint-dir``, the global training saves its state (model, AdamW moments, the losses so far and
torch's random generator) to ``DIR/<mode>`` every ``--checkpoint-every`` steps; with ``--resume`` it starts
from that checkpoint where there is one, skipping the batches it already trained on. Under
``torchrun --max-restarts=1``, a rank that dies mid-run restarts the job, which resumes from the last
checkpoint and trains on to the same losses as an uninterrupted run (docs/checkpoint.md).
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
import os
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import sbp_torch as st
from sbp_torch.sbp import broadcast, split

VOCAB, CONTEXT, WIDTH, HEADS, LAYERS, BATCH = 37, 8, 32, 4, 2, 4


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("future", torch.triu(torch.ones(CONTEXT, CONTEXT, dtype=torch.bool), diagonal=1))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (proj(x).view(b, t, HEADS, c // HEADS).transpose(1, 2) for proj in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // HEADS)
        scores = scores.masked_fill(self.future[:t, :t], float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(WIDTH), Attention()
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers: int = LAYERS):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.Sequential(*(Block() for _ in range(layers)))
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tokens.weight  # tied
        nn.init.normal_(self.tokens.weight, std=0.02)
        self.register_buffer("steps", torch.arange(CONTEXT))

    def forward(self, idx, targets):
        x = self.tokens(idx) + self.positions(self.steps[: idx.shape[1]])
        logits = self.head(self.ln(self.blocks(x)))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


# Megatron-style tensor parallel plan on one mesh axis: parameter name pattern -> SBP on that axis.
TENSOR_PARALLEL = {
    "tokens.weight": split(0),  # vocabulary-parallel embedding, tied to the LM head
    "head.weight": split(0),
    "blocks.*.attn.[qkv].weight": split(0),  # column parallel: heads split
    "blocks.*.attn.[qkv].bias": split(0),
    "blocks.*.attn.out.weight": split(1),  # row parallel: partial sums
    "blocks.*.mlp.0.weight": split(0),
    "blocks.*.mlp.0.bias": split(0),
    "blocks.*.mlp.2.weight": split(1),
}


def plans(world: int) -> dict:
    """mode -> (placement, parameter plan, batch SBP)."""
    line = st.placement("cpu", list(range(world)))
    mesh = st.placement("cpu", [[0, 1], [2, 3]])
    return {
        "dp": (line, broadcast, split(0)),
        "tp": (line, TENSOR_PARALLEL, broadcast),
        "dp_tp": (mesh, {name: (broadcast, sbp) for name, sbp in TENSOR_PARALLEL.items()}, (split(0), broadcast)),
    }


def batches(steps: int, batch: int = BATCH):
    gen = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        tokens = torch.randint(VOCAB, (batch, CONTEXT + 1), generator=gen)
        yield tokens[:, :-1], tokens[:, 1:]


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def step_loss(model: nn.Module, optimizer: torch.optim.Optimizer, idx, targets, layout=lambda t: t):
    """One step of AdamW on one batch; returns the loss tensor. ``layout`` lays the batch out (e.g. ``to_global``)."""
    loss = model(layout(idx), layout(targets))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, idx, targets, layout=lambda t: t) -> float:
    """``step_loss``, returning the loss as a number."""
    return step_loss(model, optimizer, idx, targets, layout).item()


class Checkpointing(NamedTuple):
    """Where the training state is saved (``path``), how often (``every`` steps), and whether to start from it."""

    path: str
    every: int = 5
    resume: bool = False


def train(
    model: nn.Module,
    steps: int,
    layout=lambda t: t,
    batch: int = BATCH,
    backend=None,
    checkpoint=None,
    whole_step=None,
) -> list[float]:
    """Losses of ``steps`` AdamW steps; with ``backend``, the model and the optimizer step compiled by it; with
    ``whole_step`` (a backend), each step one program by ``sbp_torch.compile_step``; with ``checkpoint`` (a
    ``Checkpointing``), saved along the way and resumed."""
    optimizer = make_optimizer(model)
    state = {"model": model, "optim": optimizer, "losses": [], "rng": torch.get_rng_state()}
    if checkpoint and checkpoint.resume and os.path.exists(checkpoint.path):
        st.checkpoint.load(state, checkpoint.path)
        torch.set_rng_state(state["rng"])
        if dist.get_rank() == 0:
            print(f"resumed from the checkpoint after step {len(state['losses'])}", flush=True)
    if backend is not None:
        torch._dynamo.reset()  # each mode compiles afresh (docs/compile.md: several optimizers in one process)
        model = torch.compile(model, backend=backend, fullgraph=True)
        optimizer.step = torch.compile(optimizer.step, backend=backend)
    one_step = functools.partial(train_step, model, optimizer, layout=layout)
    if whole_step is not None:
        compiled = st.compile_step(
            functools.partial(step_loss, model, optimizer, layout=layout),
            model=model,
            optimizer=optimizer,
            backend=whole_step,
        )
        one_step = lambda idx, targets: compiled(idx, targets).item()  # noqa: E731
    losses = state["losses"]
    for step, (idx, targets) in enumerate(batches(steps, batch)):
        if step < len(losses):
            continue  # trained on before the checkpoint: the data order stays that of an uninterrupted run
        losses.append(one_step(idx, targets))
        if checkpoint and (step + 1) % checkpoint.every == 0:
            st.checkpoint.save({**state, "rng": torch.get_rng_state()}, checkpoint.path)
    return losses


def run(mode: str, steps: int, backend=None, checkpoint=None, whole_step=None) -> tuple[list[float], list[float]]:
    """(single-process losses, global losses) for ``mode``, on every rank; ``backend`` compiles the global
    training, ``whole_step`` compiles each of its steps as one program, ``checkpoint`` saves and resumes it."""
    torch.manual_seed(0)
    reference = GPT()
    model = copy.deepcopy(reference)
    want = train(reference, steps)
    placement, plan, batch_sbp = plans(dist.get_world_size())[mode]
    model.to_global(placement, plan)
    replicated = (broadcast,) * placement.ndim
    layout = lambda t: t.to_global(placement, replicated).to_global(sbp=batch_sbp)  # noqa: E731
    return want, train(model, steps, layout, backend=backend, checkpoint=checkpoint, whole_step=whole_step)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mode", choices=["dp", "tp", "dp_tp", "all"], default="all")
    parser.add_argument(
        "--compile", nargs="?", const="inductor", choices=["inductor", "aot_eager"], help="torch.compile backend"
    )
    parser.add_argument(
        "--compile-step",
        nargs="?",
        const="inductor",
        choices=["inductor", "aot_eager", "eager"],
        help="each step one program by sbp_torch.compile_step, with this backend",
    )
    parser.add_argument("--checkpoint-dir", help="save the training state under this directory")
    parser.add_argument("--checkpoint-every", type=int, default=5, help="steps between checkpoints")
    parser.add_argument("--resume", action="store_true", help="start from the checkpoint, where there is one")
    args = parser.parse_args()
    st.init_process_group("gloo")  # as torch.distributed's, and a restarted job rendezvouses afresh
    for mode in ["dp", "tp", "dp_tp"] if args.mode == "all" else [args.mode]:
        checkpoint = None
        if args.checkpoint_dir:
            checkpoint = Checkpointing(os.path.join(args.checkpoint_dir, mode), args.checkpoint_every, args.resume)
        want, got = run(mode, args.steps, args.compile, checkpoint, args.compile_step)
        worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
        if dist.get_rank() == 0:
            print(
                f"{mode:6} losses {want[0]:.5f} -> {want[-1]:.5f} in {args.steps} steps; "
                f"largest relative difference from one process: {worst:.1e}",
                flush=True,
            )
            print(f"{mode:6} losses " + " ".join(f"{loss:.9g}" for loss in got), flush=True)
        assert worst < 1e-5, f"{mode}: losses differ from single-process training by {worst:.1e}"
    if dist.get_rank() == 0:
        print("all modes match single-process training", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
