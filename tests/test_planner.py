"""The planner (``sbp_torch.planner.plan``): plans found on fake tensors, saved and loaded, applied, and trained
against one process; a memory limit met or refused."""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest
import torch
import torch.distributed as dist

import sbp_torch as st
from sbp_torch import planner

from world import run_on_world

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import gpt  # noqa: E402

from zoo import dense  # noqa: E402


def _batch(rows=6):
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(gpt.VOCAB, (rows, gpt.CONTEXT + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _model():
    torch.manual_seed(0)
    return gpt.GPT(layers=3)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_plan_covers_every_parameter_and_every_mesh_and_saves_as_json(world, tmp_path):
    model = _model()
    plan = planner.plan(model, _batch(), world)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert set(plan.parameters) == names
    tried = {a["label"] for a in plan.alternatives}
    assert f"data {world}" in tried and f"tensor {world}" in tried and f"sharded data {world}" in tried
    assert (world == 4) == ("data 2 x tensor 2" in tried)
    assert plan.predicted.step_s == min(a["step_s"] for a in plan.alternatives if not a.get("replicated"))
    assert plan.boundaries == {
        "blocks.*": ", ".join("S(0)" if a == plan.data_axis else "B" for a in range(len(plan.mesh)))
    }
    path = tmp_path / "plan.json"
    plan.save(str(path))
    loaded = planner.Plan.load(str(path))
    assert loaded.to_json() == plan.to_json() and loaded.parameters == plan.parameters
    assert json.loads(path.read_text())["mesh"] == list(plan.mesh)
    assert "predicted step" in str(plan) and "layout tried" in str(plan)
    assert not dist.is_initialized()  # the fake world is gone


def test_the_search_reports_each_mesh_when_asked_and_is_quiet_by_default_off_a_terminal(capsys):
    planner.plan(_model(), _batch(), 2)
    assert capsys.readouterr().err == ""  # (pytest's stderr is no terminal)
    plan = planner.plan(_model(), _batch(), 2, progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2  # one a mesh: data 2, tensor 2
    assert lines[-1].startswith("planning [" + "#" * 24 + "] mesh 2/2 tensor 2")
    assert f"{plan.search['traces']} traces" in lines[-1]


def test_a_layout_that_runs_the_whole_step_on_every_rank_of_its_tensor_axis_is_never_chosen():
    """With a second of latency per message, data 2 x tensor 2 with nothing split over tensor is predicted faster
    than data 4 (its all-reduces span 2 ranks, not 4), yet it only repeats data 2's step on twice the ranks."""
    slow_messages = planner.CPU_GLOO.with_(intra=planner.Link(1.0, 1e9), inter=planner.Link(1.0, 1e9))
    plan = planner.plan(gpt.GPT(layers=1), _batch(8), 4, costs=slow_messages)
    replicated = [a for a in plan.alternatives if a.get("replicated")]
    assert replicated and min(a["step_s"] for a in replicated) < plan.predicted.step_s
    assert "nothing split" not in plan.label
    assert "(nothing split over tensor: not chosen)" in str(plan)


def _measured_plan_job():
    plan = planner.plan(gpt.GPT(layers=1), _batch(8), 2, measure=2)
    return plan.to_json()


@pytest.mark.gloo
def test_plan_measure_times_the_best_predicted_layouts_and_takes_the_fastest_measured():
    plans = [planner.Plan.from_json(text) for text in run_on_world(2, _measured_plan_job, _timeout=240)]
    assert all(p.to_json() == plans[0].to_json() for p in plans)  # every rank took rank 0's measurements
    plan = plans[0]
    timed = {a["label"]: a["measured_s"] for a in plan.alternatives if a.get("measured_s") is not None}
    assert len(timed) == 2 and plan.search["measured"] == 2
    assert plan.measured_s == min(timed.values()) == timed[plan.label] > 0
    assert "measured step" in str(plan) and "measured ms" in str(plan)


def test_plan_measure_needs_a_process_group_of_the_planned_size():
    with pytest.raises(ValueError, match="call it on every rank of a process group of 2 ranks"):
        planner.plan(_model(), _batch(8), 2, measure=2)


def test_a_tensor_parallel_mesh_splits_the_blocks_linears_in_pairs():
    """On a placement given as 1 x 4 (tensor only) the plan keeps that mesh; with half the memory its first plan
    needs, the blocks' linears are split, columns feeding rows, alike in every block."""
    placement = st.placement("cpu", [[0, 1, 2, 3]])
    free = planner.plan(_model(), _batch(8), placement)
    assert free.mesh == (1, 4) and (free.data_axis, free.tensor_axis) == (0, 1)
    plan = planner.plan(_model(), _batch(8), placement, memory_per_rank=0.5 * free.predicted.memory_bytes)
    assert plan.mesh == (1, 4)
    for block in range(3):
        layouts = {name: plan.parameters[f"blocks.{block}.{name}.weight"] for name in ("mlp.0", "mlp.2", "attn.out")}
        layouts.update({name: plan.parameters[f"blocks.{block}.attn.{name}.weight"] for name in "qkv"})
        assert layouts == {
            "mlp.0": "B, S(0)",
            "mlp.2": "B, S(1)",
            "attn.out": "B, S(1)",
            **dict.fromkeys("qkv", "B, S(0)"),
        }


def test_memory_limit_is_met_or_refused_with_the_smallest_found():
    model, batch = _model(), _batch(8)
    free = planner.plan(model, batch, 4)
    limit = 0.8 * free.predicted.memory_bytes
    tight = planner.plan(model, batch, 4, memory_per_rank=limit)
    assert tight.predicted.memory_bytes <= limit < free.predicted.memory_bytes
    assert tight.sharded or tight.tensor_axis is not None
    with pytest.raises(planner.PlanError, match=r"no layout fits 0\.0 MiB per rank: the smallest found needs"):
        planner.plan(model, batch, 4, memory_per_rank=1000)


def test_a_model_on_the_meta_device_plans_for_a_thousand_ranks():
    """Nothing is allocated: the parameters have no storage, the world is torch's fake backend."""
    with torch.device("meta"):
        model = _model()
    grid = st.placement("cpu", torch.arange(1024).reshape(128, 8).tolist())
    plan = planner.plan(model, _batch(1024), grid, costs=planner.H100, exhaustive_limit=3)
    assert plan.world_size == 1024 and plan.mesh == (128, 8)
    assert {a["label"] for a in plan.alternatives} == {"data 128 x tensor 8", "sharded data 128 x tensor 8"}


def test_an_unmodified_transformers_model_on_the_meta_device_plans_with_dropout_and_cache_on():
    """GPT-2 as its config makes it: dropout on (random ops on meta parts), the key/value cache on (a unit traced
    alone gets none), position ids from a factory given the parts' device (built as meta parts)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=16, vocab_size=64)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    ids = torch.zeros(8, 16, dtype=torch.long)
    plan = planner.plan(model, {"input_ids": ids, "labels": ids}, st.placement("cpu", [[0, 1], [2, 3]]))
    assert plan.decisions["transformer.h.*"].keys() == {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}
    assert plan.boundaries == {"transformer.h.*": "S(0), B"}


def _tiny_llama(use_cache: bool):
    transformers = pytest.importorskip("transformers")
    config = dense.llama_config(num_hidden_layers=1, use_cache=use_cache)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_a_transformers_model_without_its_cache_plans_by_the_values_of_its_position_ids():
    """With ``use_cache=False`` Llama checks whether its position ids describe packed sequences (a Python branch
    on a tensor made by ``arange``): the trace follows that value instead of failing on a part with no data."""
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    model = _tiny_llama(use_cache=False)
    plan = planner.plan(model, {"input_ids": ids, "labels": ids}, 2)
    assert set(plan.parameters) == {name for name, _ in model.named_parameters(remove_duplicate=False)}


class _Branching(torch.nn.Module):
    """Reads values on its way: of the batch, of a factory's result, and of one computed from a parameter."""

    def __init__(self, read_parameter: bool):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.read_parameter, self.branches = read_parameter, []

    def forward(self, x, ids):
        steps = torch.arange(ids.shape[1])
        self.branches.append((bool((ids == 7).any()), int(steps[-1]), (ids + steps).sum().item()))
        if self.read_parameter:
            steps.add_(self.linear.weight.sum().long())  # written from an unknown value: unknown from here
            self.branches.append(int(steps[0]))
        return self.linear(x).sum()


def test_the_trace_answers_reads_of_the_batchs_and_factories_values_and_refuses_any_other_naming_the_line():
    ids = torch.tensor([[1, 2, 3], [4, 7, 6]])
    model = _Branching(read_parameter=False)
    planner.plan(model, (torch.zeros(2, 4), ids), 2)
    assert set(model.branches) == {(True, 2, int((ids + torch.arange(3)).sum()))}  # what one process reads
    with pytest.raises(planner.ValueReadInPlanning, match=r"reads a tensor's value \(__int__\) at .*test_planner\.py"):
        planner.plan(_Branching(read_parameter=True), (torch.zeros(2, 4), ids), 2)


def test_a_mixture_of_experts_model_plans_with_its_experts_as_regions_and_prices_their_exchange_as_even_routing():
    """The trace runs each experts module as the region ``Module.to_global`` installs (not op by op, where
    grouped_mm's meta kernel refuses float32), and its forwards are restored after; an expert-parallel layout's
    data-dependent all-to-alls are priced as if each expert got as many rows."""
    moe = pytest.importorskip("zoo.moe")
    model, batch = moe.make("mixtral"), moe.batches(1, 8)[0]
    plan = planner.plan(model, batch, 4)
    assert set(plan.parameters) == {name for name, _ in model.named_parameters(remove_duplicate=False)}
    assert all("forward" not in m.__dict__ for m in model.modules())  # (regions gone: the model is as it was)
    placement = st.placement("cpu", [0, 1, 2, 3])
    experts = {"*.experts.*": moe.LAYOUTS["EP"].experts}
    split_experts = planner.predict(model, batch, placement, experts)
    replicated = planner.predict(model, batch, placement, {})
    # per layer: the counts, the rows there and back, and the gradients of both
    assert split_experts.collectives["all-to-all"] == 5 * model.config.num_hidden_layers
    assert split_experts.comm_s > replicated.comm_s


def test_a_compiled_step_is_priced_without_the_host_time_of_each_op_and_the_plan_says_which_step_it_priced():
    eager, compiled = (planner.plan(_model(), _batch(8), 2, compiled=c) for c in (False, True))
    assert (eager.step, compiled.step) == ("eager", "compiled") and "compiled step" in str(compiled).splitlines()[0]
    assert compiled.predicted.step_s < eager.predicted.step_s
    assert planner.CPU_GLOO.for_step(compiled=True).op_overhead_s == 0 < planner.CPU_GLOO.op_overhead_s
    with pytest.raises(ValueError, match="times eager steps"):
        planner.plan(_model(), _batch(8), 2, compiled=True, measure=2)


class _WritingIntoItsBatch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.seen = torch.nn.Linear(4, 4), []

    def forward(self, x, ids):
        ids.add_(1)
        self.seen.append(int(ids.sum()))
        return self.linear(x).sum()


def test_a_model_that_writes_into_its_batch_reads_in_every_trace_what_one_process_reads_and_leaves_the_batch_be():
    ids = torch.zeros(2, 3, dtype=torch.long)
    model = _WritingIntoItsBatch()
    planner.plan(model, (torch.zeros(2, 4), ids), 2)
    assert int(ids.sum()) == 0 and len(model.seen) > 1 and set(model.seen) == {6}


def test_every_cost_model_prices_every_collective_the_package_issues():
    from sbp_torch._boxing import POINT_TO_POINT as SEND_RECV
    from sbp_torch._comm import POINT_TO_POINT as EXCHANGE

    kinds = ["all-reduce(sum)", "all-reduce(max)", "reduce-scatter(sum)", "all-gather", "all-to-all", "broadcast"]
    for costs in (planner.H100, planner.A100, planner.CPU_GLOO):
        for kind in [*kinds, "all-gather (uneven, as all-to-all)", SEND_RECV, EXCHANGE]:
            assert costs.collective_s(kind, (0, 1, 2, 3), 1 << 20) > costs.collective_s(kind, (0, 1, 2, 3), 0) > 0


def _train(model, plan_or_none, steps=3):
    optimizer = gpt.make_optimizer(model)
    losses = []
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        tokens = torch.randint(gpt.VOCAB, (6, gpt.CONTEXT + 1), generator=gen)
        idx, targets = tokens[:, :-1], tokens[:, 1:]
        if plan_or_none is not None:
            idx, targets = plan_or_none.layout((idx, targets))
        loss = model(idx, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, optimizer


def test_under_a_memory_limit_the_plan_recomputes_units_in_backward_where_storage_alone_does_not_fit():
    """64 rows: activations dominate. Recomputing the blocks keeps only each block's input (and, while a block's
    backward runs, its activations once more), for one more forward of the blocks."""
    model, batch = _model(), _batch(64)
    free = planner.plan(model, batch, 2)
    assert not free.recompute  # (without a limit recomputation only costs time)
    limit = 0.75 * free.predicted.memory_bytes
    tight = planner.plan(model, batch, 2, memory_per_rank=limit)
    assert tight.recompute == ["blocks.*"] and "recomputed in backward: blocks.*" in str(tight)
    assert tight.predicted.memory_bytes <= limit and tight.predicted.memory["recomputed"] > 0
    assert tight.predicted.memory["activations"] < free.predicted.memory["activations"] / 4
    assert tight.predicted.compute_s > free.predicted.compute_s  # the blocks' forward, again
    assert planner.Plan.from_json(tight.to_json()).recompute == ["blocks.*"]


def _recomputing_job(sharded):
    reference = _model()
    model = copy.deepcopy(reference)
    plan = planner.plan(model, _batch(), dist.get_world_size())
    plan.recompute, plan.sharded = ["blocks.*"], sharded  # (a plan is data: edited, it applies as it reads)
    if sharded:
        plan.data_axis = 0
    model.to_global(plan)
    calls = []
    model.blocks[0].register_forward_pre_hook(lambda module, args: calls.append(torch.is_grad_enabled()))
    want, _ = _train(reference, None)
    got, _ = _train(model, plan)
    return want, got, calls


@pytest.mark.gloo
@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sharded"])
def test_a_plan_that_recomputes_its_units_trains_like_one_process(sharded):
    for want, got, calls in run_on_world(2, _recomputing_job, sharded, _timeout=240):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
        assert len(calls) == 2 * 3  # each step: the forward, then its recomputation in backward


def _planned_job(mesh, memory_fraction):
    reference = _model()
    model = copy.deepcopy(reference)
    target = st.placement("cpu", mesh) if mesh is not None else dist.get_world_size()
    free = planner.plan(model, _batch(), target)
    limit = None if memory_fraction is None else memory_fraction * free.predicted.memory_bytes
    plan = planner.plan(model, _batch(), target, memory_per_rank=limit)
    model.to_global(plan)
    pinned = [name for name, m in model.named_modules() if getattr(m, "_sbp_torch_boundary_pin", None)]
    assert pinned == [f"blocks.{i}" for i in range(len(model.blocks))]  # the units' edges, not the modules inside
    want, _ = _train(reference, None)
    got, optimizer = _train(model, plan)
    report = st.memory_report(model, optimizer)
    return plan.to_json(), want, got, report.parameters, plan.predicted.memory["parameters"]


@pytest.mark.gloo
@pytest.mark.parametrize(
    "world,mesh,memory_fraction",
    [(3, None, None), (4, [[0, 1], [2, 3]], None), (4, None, 0.8)],  # 1-D uneven, 2-D, sharded under a limit
    ids=["3-ranks", "2x2", "4-ranks-memory-limited"],
)
def test_a_planned_model_trains_like_one_process(world, mesh, memory_fraction):
    results = run_on_world(world, _planned_job, mesh, memory_fraction, _timeout=240)
    plans = {r[0] for r in results}
    assert len(plans) == 1  # every rank applied the same plan
    for _, want, got, stored, predicted in results:
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
        assert stored <= predicted  # predicted for rank 0, whose parts are the largest
    assert results[0][3] == results[0][4]
    plan = planner.Plan.from_json(plans.pop())
    if memory_fraction is not None:
        assert plan.sharded or plan.tensor_axis is not None
