"""Sharded data parallelism (``Module.to_global(..., shard=axis)``) under ``torch.compile``, against one process."""

from __future__ import annotations

import copy

import pytest
import torch

# (before Dynamo, as a user imports them: Dynamo then takes ``Tensor.to_global`` for a torch method, as it did here)
from sbp_torch.sbp import broadcast
from zoo.gpt import load_example

from world import run_on_world

pytestmark = pytest.mark.gloo


def _sharded_compiled_losses(steps: int):
    from torch._dynamo.utils import counters

    gpt = load_example()
    torch.manual_seed(0)
    reference = gpt.GPT(1)  # one block has every kind of gather; a second only doubles what Inductor compiles
    model = copy.deepcopy(reference)
    want = gpt.train(reference, steps)
    placement, plan, batch_sbp = gpt.plans(4)["dp_tp"]
    model.to_global(placement, plan, shard=0)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    optimizer = gpt.make_optimizer(model)
    layout = lambda t: t.to_global(placement, (broadcast,) * 2).to_global(sbp=batch_sbp)  # noqa: E731
    got = [gpt.train_step(compiled, optimizer, idx, targets, layout) for idx, targets in gpt.batches(steps)]
    return want, got, counters["stats"]["unique_graphs"], model._sbp_torch_sharded.memory()["gathered_peak"]


def test_sharded_gpt_compiled_by_inductor_trains_like_one_process():
    """The GPT example (one block) with its dp_tp plan on a 2x2 mesh, its parameters sharded over the data axis, the
    model compiled whole (``fullgraph=True``): the losses of three AdamW steps match one process's. Every gather is
    in the one compiled graph, the root's parameters' included (their modules' hooks run inside the compiled
    forward, the root's own hooks outside it), and none runs eagerly."""
    for want, got, graphs, gathered_eagerly in run_on_world(4, _sharded_compiled_losses, 3, _timeout=300):
        assert max(abs(g - w) / abs(w) for g, w in zip(got, want)) < 1e-5, (want, got)
        assert (graphs, gathered_eagerly) == (1, 0)
