"""The pipeline timeline (``pipeline/_timeline.py``): busy fractions, the Chrome trace and the Gantt chart of
known events; and a pipeline's own timeline, gathered from every rank."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import sbp_torch as st
from sbp_torch.pipeline import Pipeline
from sbp_torch.pipeline._timeline import Timeline

from world import run_on_world

# rank -> (actor, kind, micro-batch, start s, end s): rank 0 computes 0-4 s, then waits; rank 1 computes 2-6 s
EVENTS = [
    [("forward s0", "forward", 0, 10.0, 12.0), ("backward s0", "backward", 0, 12.0, 14.0)],
    [("recv activation s1", "transfer", 0, 11.0, 12.0), ("forward s1", "forward", 0, 12.0, 16.0)],
]


def test_busy_fraction_counts_compute_over_the_whole_step():
    timeline = Timeline(EVENTS)
    assert timeline.origin == 10.0
    assert timeline.busy_fraction(0) == pytest.approx(4 / 6)  # the step spans 10-16 s on every rank
    assert timeline.busy_fraction(1) == pytest.approx(4 / 6)
    assert timeline.busy_fraction(1, kinds=("transfer",)) == pytest.approx(1 / 6)


def test_chrome_trace_has_one_process_per_rank_and_times_in_microseconds(tmp_path):
    path = tmp_path / "trace.json"
    Timeline(EVENTS).write_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {0: "rank 0", 1: "rank 1"}
    spans = sorted((e["pid"], e["tid"], e["ts"], e["dur"]) for e in events if e["ph"] == "X")
    assert spans == [
        (0, "backward s0", 2e6, 2e6),
        (0, "forward s0", 0.0, 2e6),
        (1, "forward s1", 2e6, 4e6),
        (1, "recv activation s1", 1e6, 1e6),
    ]


def test_gantt_chart_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "timeline.png"
    Timeline(EVENTS).write_png(str(path), title="two ranks")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _pipeline_timeline():
    stages = [nn.Linear(3, 3).to_global(st.placement("cpu", [r])) for r in range(2)]
    pipe = Pipeline(stages, nn.functional.mse_loss, micro_batches=3, schedule="gpipe")
    pipe.step(torch.ones(6, 3), torch.zeros(6, 3))
    return pipe.timeline().ranks


@pytest.mark.gloo
def test_a_pipeline_gathers_every_ranks_events():
    """Every rank gets every rank's events: three forwards and three backwards per stage, and the transfers."""
    for ranks in run_on_world(2, _pipeline_timeline):
        for stage, events in enumerate(ranks):
            kinds = [kind for _, kind, *_ in events]
            assert kinds.count("forward") == 3 and kinds.count("backward") == 3
            assert kinds.count("transfer") == 6  # activations one way, gradients the other, 3 micro-batches each
            assert all(actor.endswith(f"s{stage}") for actor, *_ in events)
            assert all(start <= end for *_, start, end in events)
