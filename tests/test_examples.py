"""Short versions of the training examples, on a real 4-rank world, against single-process training."""

from __future__ import annotations

import importlib.util
import os

import pytest

from world import run_on_world

pytestmark = pytest.mark.gloo

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gpt_losses(mode, steps, backend=None):
    import torch._dynamo

    torch._dynamo.reset()
    return _load("gpt").run(mode, steps, backend)


def _mlp_losses(steps):
    mlp = _load("mlp_data_parallel")
    import sbp_torch as st
    from sbp_torch.sbp import broadcast, split

    placement = st.placement.all("cpu")
    reference = mlp.make_model()
    model = mlp.make_model().to_global(placement)
    return mlp.train(reference, steps), mlp.train(
        model, steps, lambda t: t.to_global(placement, broadcast).to_global(sbp=split(0))
    )


def _close(want, got):
    return max(abs(g - w) / abs(w) for g, w in zip(got, want)) < 1e-5


@pytest.mark.parametrize("mode", ["dp", "tp", "dp_tp"])
def test_gpt_trains_like_one_process(mode):
    for want, got in run_on_world(4, _gpt_losses, mode, 3):
        assert _close(want, got), (want, got)


def test_gpt_compiled_trains_like_one_process():
    """``examples/gpt.py --compile aot_eager --mode dp_tp``: 6 AdamW steps, the losses within 1e-5 relative.
    (The 2-D mode holds both the data-parallel reduction and the tensor-parallel collectives; the compile
    benchmark checks the other modes' losses, compiled by Inductor.)"""
    for want, got in run_on_world(4, _gpt_losses, "dp_tp", 6, "aot_eager"):
        assert _close(want, got), (want, got)


def test_mlp_data_parallel_trains_like_one_process():
    for want, got in run_on_world(4, _mlp_losses, 4):
        assert _close(want, got), (want, got)


def _gpt_pipeline_losses(mode, steps, schedule, backend=None):
    import torch._dynamo

    torch._dynamo.reset()
    return _load("gpt_pipeline").run(mode, steps, schedule, backend)


@pytest.mark.parametrize(
    "world,mode,schedule",
    [(2, "pp", "1f1b"), (4, "pp", "gpipe"), (4, "pp_tp", "1f1b"), (4, "pp_dp", "gpipe"), (2, "pp_interleaved", "1f1b")],
)
def test_gpt_pipelined_trains_like_one_process(world, mode, schedule):
    for want, got, drift in run_on_world(world, _gpt_pipeline_losses, mode, 3, schedule):
        assert _close(want, got), (want, got)
        assert drift == 0.0, "the tied embedding and head copies must stay equal"


def test_gpt_pipelined_with_compiled_stages_trains_like_one_process():
    """``examples/gpt_pipeline.py --compile aot_eager``: two tensor-parallel stages, each one's forward and
    backward compiled."""
    for want, got, drift in run_on_world(4, _gpt_pipeline_losses, "pp_tp", 3, "1f1b", "aot_eager"):
        assert _close(want, got), (want, got)
        assert drift == 0.0
