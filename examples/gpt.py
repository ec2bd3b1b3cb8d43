"""A GPT-style transformer trained with data, tensor (Megatron-style) and hybrid parallelism on CPU ranks.

    python -m torch.distributed.run --standalone --nproc-per-node 4 examples/gpt.py [--steps 20] [--mode all]
        [--compile [inductor|aot_eager]]

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
and the optimizer step run through ``torch.compile``; the single-process reference stays eager.
"""

from __future__ import annotations

import argparse
import copy
import math

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


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, idx, targets, layout=lambda t: t) -> float:
    """One step of AdamW on one batch; returns the loss. ``layout`` lays the batch out (e.g. ``to_global``)."""
    loss = model(layout(idx), layout(targets))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def train(model: nn.Module, steps: int, layout=lambda t: t, batch: int = BATCH, backend=None) -> list[float]:
    """Losses of ``steps`` AdamW steps; with ``backend``, the model and the optimizer step compiled by it."""
    optimizer = make_optimizer(model)
    if backend is not None:
        torch._dynamo.reset()  # each mode compiles afresh (docs/compile.md: several optimizers in one process)
        model = torch.compile(model, backend=backend, fullgraph=True)
        optimizer.step = torch.compile(optimizer.step, backend=backend)
    return [train_step(model, optimizer, idx, targets, layout) for idx, targets in batches(steps, batch)]


def run(mode: str, steps: int, backend=None) -> tuple[list[float], list[float]]:
    """(single-process losses, global losses) for ``mode``, on every rank; ``backend`` compiles the global
    training."""
    torch.manual_seed(0)
    reference = GPT()
    model = copy.deepcopy(reference)
    want = train(reference, steps)
    placement, plan, batch_sbp = plans(dist.get_world_size())[mode]
    model.to_global(placement, plan)
    replicated = (broadcast,) * placement.ndim
    got = train(model, steps, lambda t: t.to_global(placement, replicated).to_global(sbp=batch_sbp), backend=backend)
    return want, got


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mode", choices=["dp", "tp", "dp_tp", "all"], default="all")
    parser.add_argument(
        "--compile", nargs="?", const="inductor", choices=["inductor", "aot_eager"], help="torch.compile backend"
    )
    args = parser.parse_args()
    dist.init_process_group("gloo")
    for mode in ["dp", "tp", "dp_tp"] if args.mode == "all" else [args.mode]:
        want, got = run(mode, args.steps, args.compile)
        worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
        if dist.get_rank() == 0:
            print(
                f"{mode:6} losses {want[0]:.5f} -> {want[-1]:.5f} in {args.steps} steps; "
                f"largest relative difference from one process: {worst:.1e}",
                flush=True,
            )
        assert worst < 1e-5, f"{mode}: losses differ from single-process training by {worst:.1e}"
    if dist.get_rank() == 0:
        print("all modes match single-process training", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
