"""How the zoo's models train: AdamW (learning rate 1e-2) on the ``loss`` a ``transformers`` model returns for a
batch of keyword arguments, laid out or as one process. Dense models (``zoo.dense``) and MoE models (``zoo.moe``)
train alike, so the tests that compare a layout with one process and the suites that time it share these steps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def trainer(model: torch.nn.Module, lay_out_batch: Callable = lambda t: t) -> Callable[[dict], float]:
    """One training step as a function of the batch, on an AdamW of its own: lay out each batch tensor, forward,
    ``zero_grad``, backward, ``step()``; returns the loss as a float."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(batch: dict) -> float:
        loss = model(**{k: lay_out_batch(v) for k, v in batch.items()}).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def train(model: torch.nn.Module, steps: list[dict], lay_out_batch: Callable = lambda t: t) -> tuple[list, dict]:
    """(Each step's loss as a float, the last step's gradients by parameter name as plain tensors.)"""
    step = trainer(model, lay_out_batch)
    losses = [step(batch) for batch in steps]
    grads = {name: _plain(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    return losses, grads


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t
