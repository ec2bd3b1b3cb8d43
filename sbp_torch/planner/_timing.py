"""Timing candidate plans for a few real training steps, for ``plan(..., measure=k)``: where the cost model
separates layouts by less than its error, the measurement decides."""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from ._plan import Plan
from ._tracing import step_loss


def optimizer_for(optimizer, parameters):
    """An instance of ``optimizer`` (a class, or the name of one in ``torch.optim`` in any case, as ``plan`` takes it;
    ``"none"``: None) over ``parameters``, with its default hyperparameters."""
    if optimizer is None or (isinstance(optimizer, str) and optimizer.lower() == "none"):
        return None
    if isinstance(optimizer, str):
        optimizer = next(getattr(torch.optim, name) for name in dir(torch.optim) if name.lower() == optimizer.lower())
    return optimizer(parameters)


def step_seconds(model: nn.Module, batch, plan: Plan, optimizer, loss, *, steps: int = 3, warmup: int = 1) -> float:
    """The median seconds of one training step (forward, backward, optimizer step) of a copy of ``model`` laid out
    by ``plan`` on ``batch`` (the whole batch, the same on every rank), after ``warmup`` steps. A step takes as
    long as its slowest rank: each step's time is the largest any rank saw. Every rank of the group calls it."""
    laid_out = plan.apply_to(copy.deepcopy(model))
    stepper = optimizer_for(optimizer, laid_out.parameters())
    inputs = plan.layout(batch)
    cuda = plan.device == "cuda"
    times = []
    for _ in range(warmup + steps):
        dist.barrier()
        started = time.perf_counter()
        step_loss(laid_out, inputs, loss).backward()
        if stepper is not None:
            stepper.step()
        laid_out.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    slowest = torch.tensor(times[warmup:], dtype=torch.float64, device="cuda" if cuda else "cpu")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist())
