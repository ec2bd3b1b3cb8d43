"""The model zoo (``zoo/dense.py``): six unmodified ``transformers`` architectures, each trained five AdamW
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

from zoo import dense, training  # noqa: E402  (after the skip: it names transformers models)

pytestmark = pytest.mark.gloo

STEPS = 3  # the first call of each op decides, the others replay its cached decision: two replays
# In float64, so that what is compared is the layout, not float32 rounding: after a few AdamW steps (which scale
# each update to about the learning rate, however small its gradient) rounding differences of 1e-7 in a step's
# gradient grow to parameter differences that move some gradients by 1e-4 of their scale.
DTYPE = torch.float64


def _run(name: str) -> tuple:
    model = next(m for m in dense.ZOO if m.name == name)
    steps = dense.batches(model, STEPS, DTYPE)
    reference = training.train(dense.make(model, DTYPE), steps)
    results = {}
    for layout in dense.LAYOUTS:
        laid_out, lay_out_batch = dense.lay_out(model, layout, DTYPE)
        results[layout.name] = training.train(laid_out, steps, lay_out_batch)
    return reference, results


@pytest.mark.parametrize("name", [m.name for m in dense.ZOO])
def test_an_unmodified_model_trains_like_one_process_in_every_layout(name):
    for rank, ((want_losses, want_grads), results) in enumerate(run_on_world(4, _run, name, _timeout=300)):
        _check(f"{name} on rank {rank}", want_losses, want_grads, results)


def _run_compiled(name: str, layout_name: str) -> tuple:
    """The model's forward compiled (``fullgraph=True``, ``aot_eager``), laid out by one layout."""
    model = next(m for m in dense.ZOO if m.name == name)
    layout = next(lay for lay in dense.LAYOUTS if lay.name == layout_name)
    steps = dense.batches(model, STEPS, DTYPE)
    reference = training.train(dense.make(model, DTYPE), steps)
    torch._dynamo.reset()
    laid_out, lay_out_batch = dense.lay_out(model, layout, DTYPE)
    laid_out.forward = torch.compile(laid_out.forward, backend="aot_eager", fullgraph=True)
    return reference, {layout_name: training.train(laid_out, steps, lay_out_batch)}


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


def _gpt2_compiled(how: str) -> tuple:
    """GPT-2 in data parallelism on 2 ranks, compiled as ``torch.compile(model)`` or by its forward. Its forward
    builds its position ids with ``torch.arange`` under global mode, which must give a global tensor inside the
    compiled program on every supported torch (on torch 2.11 it stayed plain, and ``embedding`` refused it)."""
    import transformers as tf

    from sbp_torch.sbp import split

    def make():
        config = tf.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=dense.VOCAB, n_positions=16, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        model = tf.GPT2LMHeadModel(config)
        model.loss_type = "ForCausalLM"  # (unset, transformers logs a warning, which torch 2.11's Dynamo cannot trace)
        return model

    model = dense.ZooModel("gpt2", make, dense._tokens, (), ())
    steps = dense.batches(model, 2, DTYPE)
    reference = training.train(dense.make(model, DTYPE), steps)
    torch._dynamo.reset()
    dp = dense.Layout("dp", [0, 1], lambda m: None, (split(0),))
    laid_out, lay_out_batch = dense.lay_out(model, dp, DTYPE)
    if how == "module":
        laid_out = torch.compile(laid_out, backend="aot_eager", fullgraph=True)
    else:
        laid_out.forward = torch.compile(laid_out.forward, backend="aot_eager", fullgraph=True)
    losses, grads = training.train(laid_out, steps, lay_out_batch)
    return reference, {how: (losses, {k.removeprefix("_orig_mod."): g for k, g in grads.items()})}


@pytest.mark.parametrize("how", ["module", "forward"])
def test_gpt2_compiled_builds_its_positions_as_global_tensors(how):
    for rank, ((want_losses, want_grads), got) in enumerate(run_on_world(2, _gpt2_compiled, how, _timeout=300)):
        _check(f"gpt2 compiled ({how}) on rank {rank}", want_losses, want_grads, got)
