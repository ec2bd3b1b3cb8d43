"""Mixture of experts on 4 CPU ranks: what one training step sends and how long it takes, for unmodified
``transformers`` Mixtral, Qwen3-MoE and DeepSeek-V3 (``zoo/moe.py``: top-2 routing, 4, 6 and 4 experts, their
default ``grouped_mm`` experts code) laid out by sbp_torch, beside a hand-written expert-parallel program.

Variants (the same initial weights and batches; 8 sequences of 32 tokens, 2 per rank; ``use_cache=False``, as in
training, for every variant):

* ``DP``: every parameter broadcast, the batch ``split(0)``. Nothing in a decoder layer communicates, so each runs
  as plain PyTorch on the parts (``_api/_plain_units.py``).
* ``DP, each op dispatched``: the same with the plain units off (``SBP_TORCH_PLAIN_UNITS=0``): every op of every
  layer through the dispatcher.
* ``EP``: the experts' weights ``split(0)`` (the expert dim) over the 4 ranks, everything else broadcast, the batch
  ``split(0)``.
* ``DP x EP``: a 2x2 grid, the experts ``(broadcast, split(0))``, the batch ``(split(0), split(0))``.
* ``hand EP``: the floor. Plain tensors, one process per rank: each rank holds its own experts (the same slices as
  ``EP``) and runs its 2 sequences; each experts module sends the routing counts, then each token row to the
  rank of its expert, with ``torch.distributed.nn.functional.all_to_all_single`` (differentiable), computes there
  with the model's own experts code, and sends the rows back. After backward, the gradients of the other
  parameters are averaged in one all-reduce of one flat buffer and the experts' scaled by 1/4 (the loss is the
  mean of the ranks' means); the loss is all-reduced to report it.
* ``hand DP``: the same program with every expert on every rank and no exchange: plain data parallelism, the
  floor of ``DP``, which shows what a step of global tensors costs beyond the plain one in any model.

Measured per variant: the collectives of one step by kind (``comm.observing`` of the first step for sbp_torch:
forward, backward and gradient reduction, not the batch's layout; counted in the hand-written program as it issues
them), the bytes this rank puts into them, the step time (forward, backward, AdamW step, loss as a number; the slowest
rank's, median and quartiles over the timed rounds, variants taking turns; the batch is laid out before the clock
starts, as the hand-written program slices its rows before, since that cost is the same for a dense model: the train
suite has it), and the losses of 5 steps against one process (largest relative difference).

Targets (issue #28), reported, not asserted: DP issues only gradient reductions (and the loss's); EP one
all-to-all to dispatch and one to combine per MoE layer forward, the same backward, no expert weight gathered; EP
bytes within 1.1x and step time within 1.1x of ``hand EP``; losses within 1e-5 of one process.
"""

from __future__ import annotations

import collections
import contextlib

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

from benchmarks import harness
from sbp_torch import _comm as comm
from sbp_torch._api import _plain_units as plain_units
from sbp_torch._api._explain import Explanation, recorder
from sbp_torch._layout import balanced_part
from zoo import moe, training

TITLE = "Mixture of experts: data, expert and 2-D parallel MoE models beside hand-written expert parallelism"
WORLDS = [4]
ROWS, SEQ = 8, 32
VARIANTS = ["DP", "DP, each op dispatched", "EP", "DP x EP", "hand DP", "hand EP"]


class _HandExperts:
    """The forward of one experts module in the hand-written program: this rank holds experts ``[start, start +
    count)``; every rank holds the same number or one fewer (balanced parts)."""

    def __init__(self, module, rank: int, world: int, sent: collections.Counter):
        self.module, self.original, self.sent, self.world = module, module.forward, sent, world
        total = module.num_experts
        parts = [balanced_part(total, world, r) for r in range(world)]
        self.start, self.count = parts[rank]
        self.most = max(n for _, n in parts)
        owner = [r for r, (s, n) in enumerate(parts) for _ in range(n)]
        self.dest = torch.tensor(owner)
        self.first = torch.tensor([parts[r][0] for r in owner])
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(module, name)
            setattr(module, name, torch.nn.Parameter(full.detach()[self.start : self.start + self.count].clone()))

    def __call__(self, hidden, top_k_index, top_k_weights):
        k = top_k_index.shape[-1]
        expert = top_k_index.reshape(-1)
        key = self.dest[expert] * self.most + expert - self.first[expert]
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=self.world * self.most).view(self.world, self.most)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts)
        self.sent["all-to-all"] += 1
        self.sent["bytes"] += counts.nbytes
        send, recv = counts.sum(1).tolist(), received.sum(1).tolist()
        rows = hidden[order // k]
        arrived = _exchange(rows, recv, send, self.sent)
        local = torch.arange(self.most).repeat(self.world)
        expert_ids = torch.repeat_interleave(local, received.reshape(-1)).unsqueeze(-1)
        kept = self.module.num_experts
        self.module.num_experts = self.count
        try:
            out = self.original(arrived, expert_ids, torch.ones(len(arrived), 1))
        finally:
            self.module.num_experts = kept
        back = _exchange(out, send, recv, self.sent)
        weighted = back * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(hidden).index_add(0, order // k, weighted)


def _exchange(rows, recv, send, sent):
    sent["bytes"] += rows.nbytes
    sent["all-to-all"] += 1
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    return _CountedBackward.apply(dist_fn.all_to_all_single(out, rows.contiguous(), recv, send), sent)


class _CountedBackward(torch.autograd.Function):
    """Counts the all-to-all that the backward of ``all_to_all_single`` issues for ``x``'s gradient."""

    @staticmethod
    def forward(ctx, x, sent):
        ctx.sent = sent
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.sent["all-to-all"] += 1
        ctx.sent["bytes"] += grad.nbytes
        return grad, None


class _HandStep:
    """One step of the hand-written program; ``expert_parallel``: the experts as ``_HandExperts`` (else every rank
    holds every expert, as plain data parallelism)."""

    def __init__(self, model, batch_rows: slice, expert_parallel: bool):
        self.model, self.rows, self.sent = model, batch_rows, collections.Counter()
        self.world = dist.get_world_size()
        self.experts = [m for m in model.modules() if hasattr(m, "_is_expert_parallel")] if expert_parallel else []
        for module in self.experts:
            module.forward = _HandExperts(module, dist.get_rank(), self.world, self.sent)
        expert_params = {id(p) for m in self.experts for p in m.parameters()}
        self.replicated = [p for p in model.parameters() if id(p) not in expert_params]
        self.expert_params = [p for p in model.parameters() if id(p) in expert_params]
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def prepare(self, batch: dict) -> dict:
        return {k: v[self.rows] for k, v in batch.items()}

    def __call__(self, batch: dict) -> float:
        self.sent.clear()
        loss = self.model(**batch).loss
        self.optimizer.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in self.replicated])
        dist.all_reduce(flat)
        self.sent["all-reduce(sum)"] += 1
        self.sent["bytes"] += flat.nbytes
        for p, g in zip(self.replicated, flat.split([p.numel() for p in self.replicated])):
            p.grad.copy_(g.view_as(p) / self.world)
        for p in self.expert_params:
            p.grad.div_(self.world)
        total = loss.detach().clone()
        dist.all_reduce(total)
        self.optimizer.step()
        return total.item() / self.world


class _GlobalStep:
    def __init__(self, model, layout, plain_units: bool):
        self.model, self.lay = model, moe.lay_out(model, layout)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.found: Explanation | None = None
        self.plain_units = plain_units

    def prepare(self, batch: dict) -> dict:
        return {k: self.lay(v) for k, v in batch.items()}

    def __call__(self, batch: dict) -> float:
        plain_units.ENABLED = self.plain_units  # (variants take turns: each sets its own)
        # The first step's collectives are counted: observed, it takes the dispatcher's path op by op; blocks that
        # run plain later issue no collective of their own, and gradients are reduced alike.
        first, phase = self.found is None, {"backward": False}
        if first:
            self.found = Explanation()
        with comm.observing(recorder(self.found, phase)) if first else contextlib.nullcontext():
            loss = self.model(**batch).loss
            self.optimizer.zero_grad()
            phase["backward"] = True
            loss.backward()
        self.optimizer.step()
        return loss.item()


def _sent(step) -> tuple[dict, int]:
    """(collectives of the last step by kind, bytes this rank put in)."""
    if isinstance(step, _HandStep):
        kinds = {k: n for k, n in step.sent.items() if k != "bytes"}
        return kinds, step.sent["bytes"]
    return dict(collections.Counter(c.kind for c in step.found)), sum(c.bytes or 0 for c in step.found)


def _made(name: str):
    model = moe.make(name)
    model.config.use_cache = False  # (training: no key/value cache, which a block would fill; every variant alike)
    return model


def _variant(name: str, variant: str):
    model = _made(name)
    if variant.startswith("hand"):
        rank, world = dist.get_rank(), dist.get_world_size()
        per = ROWS // world
        return _HandStep(model, slice(rank * per, (rank + 1) * per), expert_parallel=variant == "hand EP")
    layout = variant.split(",")[0]
    return _GlobalStep(model, moe.LAYOUTS[layout], plain_units=variant == layout)


def measure(world: int, quick: bool) -> list[dict]:
    rounds, warmup = (4, 1) if quick else (20, 3)
    rows = []
    for name in moe.MODELS:
        batches = moe.batches(5, ROWS, seq=SEQ)
        want, _ = training.train(_made(name), batches)
        steps = {v: _variant(name, v) for v in VARIANTS}
        losses = {v: [step(step.prepare(b)) for b in batches] for v, step in steps.items()}  # and warm-up
        prepared = {v: step.prepare(batches[0]) for v, step in steps.items()}  # laid out before the clock
        times = harness.timed_interleaved(
            {v: (lambda step=step, batch=prepared[v]: step(batch)) for v, step in steps.items()}, rounds, warmup
        )
        for v, step in steps.items():
            kinds, nbytes = _sent(step)
            rows.append({
                "model": name, "variant": v, "time": times[v], "collectives": kinds,
                "bytes": nbytes, "loss_difference": harness.relative_difference(losses[v], want),
            })  # fmt: skip
    return rows


def report(rows: list[dict]) -> str:
    out = []
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = {r["variant"]: r for r in rows if r["model"] == name}
        floor = mine.get("hand EP")
        plain = mine.get("hand DP")
        table = [
            [
                v,
                ", ".join(f"{k} {n}" for k, n in sorted(r["collectives"].items())),
                f"{r['bytes'] / 1e3:.1f} kB",
                f"{r['bytes'] / floor['bytes']:.2f}x" if floor and floor["bytes"] else "—",
                harness.fmt(r["time"], "ms"),
                harness.ratio(r["time"], floor["time"] if floor else None),
                harness.ratio(r["time"], plain["time"] if plain else None),
                f"{r['loss_difference']:.1e}",
            ]
            for v, r in mine.items()
        ]
        out.append(f"### {name}\n")
        out.append(
            harness.markdown_table(
                [
                    "variant",
                    "collectives per step",
                    "bytes sent per rank",
                    "vs hand EP",
                    "step",
                    "vs hand EP",
                    "vs hand DP",
                    "loss vs one process",
                ],
                table,
            )  # fmt: skip
        )
        out.append("")
    return "\n".join(out)
