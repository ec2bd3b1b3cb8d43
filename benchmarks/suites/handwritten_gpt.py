"""The GPT example written by hand as a per-rank program on plain tensors, Megatron style: the floor that the
compile suite measures compiled global programs against.

Each rank holds its own slices of the example's parameters (cut from the same initial model) and runs the
collectives itself, as functional collectives that ``torch.compile`` traces:

* data parallelism: the batch split over the data-parallel group, the loss a mean over the whole batch; each
  use of a parameter passes an identity whose backward all-reduces that use's gradient over the group (the
  reduction sits in the compiled backward, where Inductor's bucketing pass merges it);
* tensor parallelism: the embedding split over the vocabulary (a masked lookup, all-reduced), q/k/v and the
  first MLP linear split by output features (heads split), the attention output and second MLP linear split
  by input features (all-reduced before their replicated bias), the LM head tied to the embedding slice so
  the logits stay split over the vocabulary, into a vocabulary-parallel cross entropy (three all-reduces);
  an identity whose backward all-reduces precedes each column-parallel layer. Layer norms and the position
  embedding are replicated.

These are the collectives sbp_torch's plans of the example (``gpt.plans``) issue, written out by hand."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.nn import functional as F


class _AllReduceBackward(torch.autograd.Function):
    """Identity forward; the gradient all-reduced (sum) over ``group`` (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return funcol.all_reduce(grad, "sum", ctx.group), None


class _AllReduceForward(torch.autograd.Function):
    """All-reduce (sum) over ``group`` forward; identity backward: the result is replicated and so is its
    gradient (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx, x, group):
        return funcol.all_reduce(x, "sum", group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _f(x, group):
    return x if group is None else _AllReduceBackward.apply(x, group)


def _g(x, group):
    return x if group is None else _AllReduceForward.apply(x, group)


def _part(t: torch.Tensor, dim: int, group) -> tuple[torch.Tensor, int]:
    """This rank's balanced slice of ``t`` along ``dim`` over ``group`` (the first slices one longer, as
    sbp_torch cuts a split), and where it starts."""
    if group is None:
        return t.detach().clone(), 0
    n, i = dist.get_world_size(group), dist.get_rank(group)
    sizes = [len(c) for c in torch.arange(t.shape[dim]).tensor_split(n)]
    return t.detach().narrow(dim, sum(sizes[:i]), sizes[i]).clone(), sum(sizes[:i])


class HandwrittenGPT(nn.Module):
    """This rank's part of ``gpt.GPT`` for a data-parallel group ``dp`` and a tensor-parallel group ``tp``
    (either None)."""

    def __init__(self, gpt, model, dp, tp):
        super().__init__()
        self.gpt, self.dp, self.tp = gpt, dp, tp
        tp_size = 1 if tp is None else dist.get_world_size(tp)
        self.heads = gpt.HEADS // tp_size
        self.layers = len(model.blocks)
        state = model.state_dict()
        split_rows = {"tokens.weight", "attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.q.bias",
                      "attn.k.bias", "attn.v.bias", "mlp.0.weight", "mlp.0.bias"}  # fmt: skip
        split_cols = {"attn.out.weight", "mlp.2.weight"}
        self.params = nn.ParameterDict()
        for name, value in state.items():
            if name in ("head.weight", "steps") or name.endswith("future"):
                continue
            short = name.split(".", 2)[-1] if name.startswith("blocks.") else name
            dim = 0 if short in split_rows else 1 if short in split_cols else None
            part, start = _part(value, dim, tp) if dim is not None else (value.detach().clone(), 0)
            if name == "tokens.weight":
                self.vocab_start = start
            self.params[name.replace(".", "_")] = nn.Parameter(part)

    def _w(self, name: str) -> torch.Tensor:
        return _f(self.params[name.replace(".", "_")], self.dp)

    def _block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        gpt, p = self.gpt, f"blocks.{i}."
        b, t, c = x.shape
        h = _f(F.layer_norm(x, (c,), self._w(p + "ln1.weight"), self._w(p + "ln1.bias")), self.tp)
        q, k, v = (
            F.linear(h, self._w(p + f"attn.{n}.weight"), self._w(p + f"attn.{n}.bias"))
            .view(b, t, self.heads, c // gpt.HEADS)
            .transpose(1, 2)
            for n in "qkv"
        )
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // gpt.HEADS)
        future = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        y = (scores.masked_fill(future, float("-inf")).softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1)
        x = x + _g(F.linear(y, self._w(p + "attn.out.weight")), self.tp) + self._w(p + "attn.out.bias")
        h = _f(F.layer_norm(x, (c,), self._w(p + "ln2.weight"), self._w(p + "ln2.bias")), self.tp)
        u = F.gelu(F.linear(h, self._w(p + "mlp.0.weight"), self._w(p + "mlp.0.bias")))
        return x + _g(F.linear(u, self._w(p + "mlp.2.weight")), self.tp) + self._w(p + "mlp.2.bias")

    def forward(self, idx, targets):
        """The mean loss over the whole batch, on every rank; ``idx`` and ``targets`` are this rank's rows."""
        tokens = self._w("tokens.weight")
        local = idx - self.vocab_start
        inside = (local >= 0) & (local < tokens.shape[0])
        x = _g(F.embedding(local.clamp(0, tokens.shape[0] - 1), tokens) * inside.unsqueeze(-1), self.tp)
        x = x + self._w("positions.weight")[: idx.shape[1]]
        for i in range(self.layers):
            x = self._block(i, x)
        x = F.layer_norm(x, (x.shape[-1],), self._w("ln.weight"), self._w("ln.bias"))
        logits = F.linear(_f(x, self.tp), tokens).reshape(-1, tokens.shape[0])
        loss = self._cross_entropy(logits, targets.reshape(-1) - self.vocab_start)
        if self.dp is None:
            return loss
        return _g(loss / dist.get_world_size(self.dp), self.dp)

    def _cross_entropy(self, logits, local_targets):
        """Mean cross entropy of logits split over the vocabulary (Megatron's vocabulary-parallel loss)."""
        if self.tp is None:
            return F.cross_entropy(logits, local_targets)
        peak = funcol.all_reduce(logits.detach().max(-1).values, "max", self.tp)
        shifted = logits - peak.unsqueeze(-1)
        total = _g(shifted.exp().sum(-1), self.tp)
        inside = (local_targets >= 0) & (local_targets < logits.shape[-1])
        picked = shifted.gather(-1, local_targets.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        target = _g(picked * inside, self.tp)
        return (total.log() - target).mean()


def groups(mode: str) -> tuple:
    """(dp, tp) process groups of ``mode`` on 4 ranks, as ``gpt.plans`` lays them out; every rank calls it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if mode == "dp":
        return dist.group.WORLD, None
    if mode == "tp":
        return None, dist.group.WORLD
    rows, cols = [[0, 1], [2, 3]], [[0, 2], [1, 3]]
    assert world == 4, "dp_tp is laid out on a 2x2 mesh"
    tp = [dist.new_group(r) for r in rows][rank // 2]
    dp = [dist.new_group(c) for c in cols][rank % 2]
    return dp, tp


def handwritten_step(gpt, model, mode: str):
    """A training step of ``model`` (a copy of the initial ``gpt.GPT``) written by hand for ``mode``:
    ``step(idx, targets) -> loss`` with the whole batch given on every rank (rank 0's is broadcast, and each
    rank keeps its rows)."""
    dp, tp = groups(mode)
    local = HandwrittenGPT(gpt, model, dp, tp)
    optimizer = gpt.make_optimizer(local)
    dp_size, dp_rank = (1, 0) if dp is None else (dist.get_world_size(dp), dist.get_rank(dp))

    def rows(t):
        # rank 0's batch, as the libraries' layouts take it (``to_global`` of a broadcast batch), then this rank's rows
        t = t.clone()
        dist.broadcast(t, 0)
        return t.tensor_split(dp_size)[dp_rank]

    step = lambda idx, targets: gpt.train_step(local, optimizer, rows(idx), rows(targets))  # noqa: E731
    return local, step
