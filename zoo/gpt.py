"""GPT models on one device, as the GPU benchmark and the host-read tests run them: the GPT example
(``examples/gpt.py``, its sizes set) and an unmodified ``transformers`` GPT-2 with ``sdpa`` attention and dropout off,
built with the same weights every time; each laid out by plain PyTorch, sbp_torch (a one-rank placement, the batch
``split(0)``) or DTensor (a one-device mesh, replicated parameters, the batch sharded); and the step compiled whole by
``sbp_torch.compile_step``."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

import torch

MODELS = ["GPT example", "transformers GPT-2"]
_EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "gpt.py")


def load_example():
    """``examples/gpt.py`` as a fresh module (``examples`` is not a package; its model is reused, not copied), the
    one ``sys.modules`` names ``gpt_example`` (Dynamo imports a compiled function's module by name)."""
    spec = importlib.util.spec_from_file_location("gpt_example", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def config(cuda: bool, quick: bool) -> dict:
    if cuda and not quick:
        return dict(layers=6, hidden=768, heads=12, seq=512, batch=8, vocab=50257, repeats=20)
    if cuda:
        return dict(layers=2, hidden=768, heads=12, seq=512, batch=8, vocab=50257, repeats=10)
    return dict(layers=2, hidden=32, heads=4, seq=16, batch=4, vocab=64, repeats=3)


def _gpt2(c: dict):
    import transformers as tf

    config = tf.GPT2Config(
        vocab_size=c["vocab"], n_positions=c["seq"], n_embd=c["hidden"], n_layer=c["layers"], n_head=c["heads"],
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
    )  # fmt: skip
    model = tf.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # named: the default's warning is a call that a compiled forward cannot hold
    return model, lambda model, ids: model(input_ids=ids, labels=ids).loss


def _example(c: dict):

    gpt = load_example()  # a fresh module: its sizes are module constants, set here before building
    gpt.VOCAB, gpt.CONTEXT, gpt.WIDTH, gpt.HEADS = c["vocab"], c["seq"], c["hidden"], c["heads"]
    return gpt.GPT(c["layers"]), lambda model, ids: model(ids, ids)


def make_model(name: str, c: dict, device: str):
    """(The model, on ``device`` with the same weights every time, and its loss of a batch of token ids.)"""
    torch.manual_seed(0)
    model, loss = (_example if name == "GPT example" else _gpt2)(c)
    return model.to(device).train(), loss


def laid_out(library: str, model, device: str):
    """(The model as ``library`` runs it, the function that lays out a batch, the context its steps run in.)"""
    if library == "sbp_torch":
        import sbp_torch as st
        from sbp_torch.sbp import broadcast, split

        placement = st.placement(device, [0])
        model.to_global(placement)
        return model, lambda ids: ids.to_global(placement, broadcast).to_global(sbp=split(0)), contextlib.nullcontext
    if library == "DTensor":
        from torch.distributed.tensor import DTensor, Shard, distribute_module, init_device_mesh
        from torch.distributed.tensor.experimental import implicit_replication

        mesh = init_device_mesh(device, (1,))
        distribute_module(model, mesh)
        return model, lambda ids: DTensor.from_local(ids, mesh, [Shard(0)]), implicit_replication
    return model, lambda ids: ids, contextlib.nullcontext


def whole_step(model, loss_of, lay_out, optimizer, backend, cuda_graphs=False):
    """The training step (batch layout, forward, backward, optimizer step) as one program by
    ``sbp_torch.compile_step`` with ``backend`` (replayed as a CUDA graph with ``cuda_graphs``)."""
    import sbp_torch as st

    @st.compile_step(model=model, optimizer=optimizer, backend=backend, cuda_graphs=cuda_graphs)
    def step(ids):
        loss = loss_of(model, lay_out(ids))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return loss

    return step
