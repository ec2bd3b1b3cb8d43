"""Data-parallel training of an MLP: broadcast parameters, a batch split over the ranks.

    python -m torch.distributed.run --standalone --nproc-per-node 4 examples/mlp_data_parallel.py

The model and the training loop are plain PyTorch. ``model.to_global(placement)`` lays every parameter out
as broadcast; the batch is split on dim 0 (7 rows per step on 4 ranks: uneven parts). Gradients arrive as
partial sums and are all-reduced, bucketed, as they are accumulated, so ``SGD`` sees broadcast gradients.
The losses are checked against the same training in one process.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import sbp_torch as st
from sbp_torch.sbp import broadcast, split


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))


def train(model, steps, layout=lambda t: t) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(7, 10, generator=gen)
        y = x.sum(dim=1, keepdim=True).sin()
        loss = nn.functional.mse_loss(model(layout(x)), layout(y))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main(steps: int = 20):
    dist.init_process_group("gloo")
    placement = st.placement.all("cpu")
    reference = make_model()
    model = copy.deepcopy(reference).to_global(placement)  # every parameter broadcast
    want = train(reference, steps)
    got = train(model, steps, lambda t: t.to_global(placement, broadcast).to_global(sbp=split(0)))
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    if dist.get_rank() == 0:
        print(
            f"loss {want[0]:.4f} -> {want[-1]:.4f} in {steps} steps; largest relative difference from one "
            f"process: {worst:.1e}",
            flush=True,
        )
    assert worst < 1e-5
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
