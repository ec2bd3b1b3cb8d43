"""Short versions of the training examples, on a real 4-rank world, against single-process training."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from world import run_on_world

pytestmark = pytest.mark.gloo

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _load(name):
    """``examples/<name>.py`` as a fresh module, which ``sys.modules`` names ``example_<name>``: dataclasses look a
    class's module up by name (``zoo.gpt.load_example`` names its own copy of the GPT example ``gpt_example``)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
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


def _train_then_resume(directory: str, plan: str):
    """``examples/train.py`` in its quickest form (the default model, laid out by ``plan``, each step one compiled
    program) for 4 steps with a checkpoint after step 2, then again resumed from that checkpoint: the two runs'
    results, as dicts."""
    import dataclasses

    train = _load("train")
    first = ["--plan", plan, "--steps", "4", "--checkpoint-dir", directory, "--checkpoint-every", "2"]
    runs = train.run(train.parse_args(first)), train.run(train.parse_args([*first, "--resume", "2"]))
    return [dataclasses.asdict(result) for result in runs]


def test_train_matches_one_process_and_resumes_bit_exactly(tmp_path):
    """The default model on 4 ranks, planned in one process (as the job's rank 0 plans before its process group
    starts; planning inside a world would trace on all 4 ranks), its step compiled: the losses are within 1e-5 of
    one process. Resumed from the checkpoint after step 2, the job trains on to the same losses to the bit (the
    resumed run, like the first, runs every step after its first as one compiled program)."""
    train = _load("train")
    args = train.parse_args(["--steps", "4"])
    train.make_plan(args, *train.model_and_batches(args), 4).save(str(tmp_path / "plan.json"))
    for first, resumed in run_on_world(4, _train_then_resume, str(tmp_path / "run"), str(tmp_path / "plan.json")):
        assert first["worst"] is not None and first["worst"] <= 1e-5, (first["losses"], first["reference"])
        assert len(resumed["step_seconds"]) == 2, "the resumed run trains steps 3 and 4 only"
        assert resumed["losses"] == first["losses"]
