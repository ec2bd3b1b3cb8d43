"""The model zoo (``benchmarks/zoo_models.py``): six unmodified ``transformers`` architectures, each trained five AdamW
steps as one process and laid out by sbp_torch three ways on 4 ranks (data parallel, Megatron-style tensor parallel,
both on a 2x2 grid), with nothing in the models changed and no context around them.

Losses must agree within 1e-5 (relative) at every step, and the last step's gradients within 1e-4 relative to the
largest gradient of their tensor. A gradient that is zero in exact arithmetic (a key projection's bias, which softmax
cancels) holds only rounding noise on both sides, so the scale is at least 1e-3 of the model's largest gradient."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from world import run_on_world

pytest.importorskip("transformers")

from benchmarks import zoo_models  # noqa: E402  (after the skip: it names transformers models)

pytestmark = pytest.mark.gloo

STEPS = 5
# In float64, so that what is compared is the layout, not float32 rounding: after a few AdamW steps (which scale
# each update to about the learning rate, however small its gradient) rounding differences of 1e-7 in a step's
# gradient grow to parameter differences that move some gradients by 1e-4 of their scale.
DTYPE = torch.float64


def _run(name: str) -> tuple:
    model = next(m for m in zoo_models.ZOO if m.name == name)
    steps = zoo_models.batches(model, STEPS, DTYPE)
    reference = zoo_models.train(zoo_models.make(model, DTYPE), steps)
    results = {}
    for layout in zoo_models.LAYOUTS:
        laid_out, lay_out_batch = zoo_models.lay_out(model, layout, DTYPE)
        results[layout.name] = zoo_models.train(laid_out, steps, lay_out_batch)
    return reference, results


@pytest.mark.parametrize("name", [m.name for m in zoo_models.ZOO])
def test_an_unmodified_model_trains_like_one_process_in_every_layout(name):
    for rank, ((want_losses, want_grads), results) in enumerate(run_on_world(4, _run, name, _timeout=300)):
        _check(f"{name} on rank {rank}", want_losses, want_grads, results)


def _run_compiled(name: str, layout_name: str) -> tuple:
    """The model's forward compiled (``fullgraph=True``, ``aot_eager``), laid out by one layout."""
    model = next(m for m in zoo_models.ZOO if m.name == name)
    layout = next(lay for lay in zoo_models.LAYOUTS if lay.name == layout_name)
    steps = zoo_models.batches(model, STEPS, DTYPE)
    reference = zoo_models.train(zoo_models.make(model, DTYPE), steps)
    torch._dynamo.reset()
    laid_out, lay_out_batch = zoo_models.lay_out(model, layout, DTYPE)
    laid_out.forward = torch.compile(laid_out.forward, backend="aot_eager", fullgraph=True)
    return reference, {layout_name: zoo_models.train(laid_out, steps, lay_out_batch)}


def test_an_unmodified_model_trains_compiled_like_one_process():
    # GPT-NeoX builds positions and masks with torch's factories inside forward, and returns its key/value cache
    # beside the loss (outputs whose gradients are never asked for); 2-D: data and tensor parallel at once.
    results = run_on_world(4, _run_compiled, "gpt_neox", "2d", _timeout=300)
    for rank, ((want_losses, want_grads), got) in enumerate(results):
        _check(f"gpt_neox compiled on rank {rank}", want_losses, want_grads, got)


def _check(what: str, want_losses: list, want_grads: dict, results: dict) -> None:
    largest = max(g.abs().max().item() for g in want_grads.values())
    for layout, (losses, grads) in results.items():
        for step, (got, want) in enumerate(zip(losses, want_losses)):
            assert abs(got - want) <= 1e-5 * abs(want), f"{what} {layout} step {step}: loss {got} != {want}"
        assert grads.keys() == want_grads.keys(), f"{what} {layout}: gradients of different parameters"
        for param, want in want_grads.items():
            scale = max(want.abs().max().item(), 1e-3 * largest)
            error = (grads[param] - want).abs().max().item()
            assert error <= 1e-4 * scale, f"{what} {layout} {param}: gradient off by {error:.2e} (scale {scale:.2e})"
