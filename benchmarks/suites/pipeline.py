"""Pipeline schedules on a synthetic workload: bubbles against theory, activations in flight, transfer overlap.

Each stage is one rank whose forward and backward sleep a fixed time (``FORWARD_S``, ``BACKWARD_S``), so the
stages are equal and the measurement is the runtime's scheduling, not arithmetic on two shared cores.

* **Bubble fraction**: ``1 - busy / span`` per rank, averaged over ranks, where ``busy`` is the time the
  rank's forward and backward actors ran and ``span`` the step from the first to the last actor event of
  any rank (the timeline). Theory for both schedules: ``(p - 1) / (m + p - 1)``.
* **Peak activations**: the most micro-batches whose forward register slot was held at once, per stage.
* **Transfer overlap**: the step time when every activation and gradient takes ``OVERLAP_SHARE`` of a forward
  to arrive, against the same step with transfers as fast as the machine makes them. Two kinds of transfer:

  - *link time*: a tiny tensor whose send waits ``OVERLAP_SHARE * FORWARD_S`` on its channel's lane before it
    is posted. This is a link that takes a fixed time per transfer and no CPU, as a GPU's copy engine or
    NIC does; the synthetic compute takes no CPU either, so it measures the scheduler's overlap alone.
  - *loopback payload*: a float32 tensor whose send alone (rank 0 to 1, nothing else running) takes that
    long over gloo. Loopback copies are CPU work on the same 2 cores as the 2-4 ranks, so this measures
    the machine as much as the scheduler.

  1F1B cannot meet the 10% target at 0.3, whatever the scheduler does: stage 0 holds at most ``p``
  micro-batches, and each one's round trip to the last stage and back crosses ``2 (p - 1)`` transfers, so
  by Little's law each micro-batch costs stage 0 at least ``F + B + 2 (p - 1) t / p``. The report gives,
  beside each row, the increase of the same order run with no overhead at all (``ideal_step``).
* **Side by side with PyTorch**: the wall time of a step of the same stages under
  ``torch.distributed.pipelining`` (its ``ScheduleGPipe`` / ``Schedule1F1B``), with tiny activations and with
  the loopback payloads.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import sbp_torch as st
from benchmarks.harness import DOCS, markdown_table
from sbp_torch.pipeline import SCHEDULES, Pipeline
from sbp_torch.pipeline import _transfer as transfer

TITLE = "Pipeline schedules: bubbles, activations in flight, transfer overlap"
WORLDS = [2, 4]
FORWARD_S, BACKWARD_S = 0.02, 0.02
OVERLAP_SHARE = 0.3


class _Sleep(torch.autograd.Function):
    """Sleeps, passes its input on (a view: no arithmetic on large activations, so that the overlap
    measurement sees the transfer, not the copies); its parameter input makes every stage's backward run."""

    @staticmethod
    def forward(ctx, x, scale, share):
        ctx.share = share
        time.sleep(FORWARD_S * share)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(BACKWARD_S * ctx.share)
        return g, None, None


class SleepStage(nn.Module):
    """A stage whose forward and backward take ``share`` of ``FORWARD_S`` / ``BACKWARD_S``; one scalar
    parameter tells its placement."""

    def __init__(self, share: float = 1.0):
        super().__init__()
        self.scale, self.share = nn.Parameter(torch.ones(())), share

    def forward(self, x):
        return _Sleep.apply(x, self.scale, self.share)


def _loss(y, t):
    """One element of the output: its backward fills a zero gradient, and no arithmetic scans the tensor."""
    return y.reshape(-1)[0]


# row name -> (schedule, virtual stages per rank)
SCHEDULE_ROWS = {"gpipe": ("gpipe", 1), "1f1b": ("1f1b", 1), "1f1b, interleaved x2": ("1f1b", 2)}


def _pipeline(world: int, m: int, schedule: str, virtual: int = 1) -> Pipeline:
    """``world`` ranks, each holding ``virtual`` stages (round robin) that together take one forward and one
    backward time per micro-batch."""
    stages = [SleepStage(1 / virtual).to_global(st.placement("cpu", [s % world])) for s in range(virtual * world)]
    return Pipeline(stages, _loss, m, schedule)


def _step_time(pipe: Pipeline, batch: torch.Tensor) -> tuple[float, object]:
    """(span of the step's actor events in seconds, timeline) for one step."""
    dist.barrier()
    pipe.step(batch, batch)
    timeline = pipe.timeline()
    events = [e for ev in timeline.ranks for e in ev]
    return max(e[4] for e in events) - min(e[3] for e in events), timeline


def _transfer_seconds(numel: int, repeats: int = 5) -> float:
    """Median time to send ``numel`` float32 from rank 0 to rank 1 (a round trip halved)."""
    buf, times = torch.ones(numel), []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif dist.get_rank() == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        times.append((time.perf_counter() - start) / 2)
    t = torch.tensor([statistics.median(times) if dist.get_rank() < 2 else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _calibrate(target_s: float) -> int:
    """Elements per micro-batch whose transfer takes about ``target_s``."""
    numel = 1 << 16
    for _ in range(6):
        took = _transfer_seconds(numel)
        numel = max(1024, int(numel * target_s / max(took, 1e-6)))
    return numel


class _LinkTime:
    """A step's lanes whose sends start with ``seconds`` spent on their lane: the transfer takes that long on
    its channel (one at a time, as on a link) and no CPU."""

    def __init__(self, lanes, seconds: float):
        self.lanes, self.seconds = lanes, seconds

    def start(self, channel, fn):
        return self.lanes.start(channel, lambda posted: (time.sleep(self.seconds), fn(posted))[1])

    def __getattr__(self, name):
        return getattr(self.lanes, name)


@contextlib.contextmanager
def _link_time(seconds: float):
    """Every stage send within takes ``seconds`` more on its lane (see ``_LinkTime``)."""
    send = transfer.send

    def timed_send(x, dst, tag, lanes, channel):
        return send(x, dst, tag, _LinkTime(lanes, seconds), channel)

    transfer.send = timed_send
    try:
        yield
    finally:
        transfer.send = send


def wall_samples(step, repeats: int) -> list[float]:
    """``repeats`` wall times of ``step()``, each from a barrier to the slowest rank's return."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        step()
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        times.append(float(took))
    return times


def _wall_seconds(step, repeats: int) -> float:
    """The median of ``wall_samples``."""
    return statistics.median(wall_samples(step, repeats))


def _torch_pipelining_step(world: int, m: int, schedule: str, batch: torch.Tensor, repeats: int) -> float:
    """Wall time of the same stages, one per rank, under ``torch.distributed.pipelining`` (PyTorch's own
    pipeline API) with its GPipe or 1F1B schedule."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    stage = PipelineStage(SleepStage(), rank, world, torch.device("cpu"))
    runner = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](stage, m, loss_fn=_loss)

    def step():
        if rank == 0:
            runner.step(batch)
        elif rank == world - 1:
            runner.step(target=batch, losses=[])
        else:
            runner.step()

    step()  # warm-up: the stages learn their shapes
    return _wall_seconds(step, repeats)


def _side_by_side_rows(world: int, m: int, schedule: str, numel: int, repeats: int) -> list[dict]:
    """Wall times of a step, sbp_torch beside torch.distributed.pipelining, with tiny and loopback payloads."""
    pipe, rows = _pipeline(world, m, schedule), []
    for payload, cols in [("tiny", 4), ("loopback payload", numel)]:
        batch = torch.ones(m, cols)
        pipe.step(batch, batch)
        ours = _wall_seconds(lambda: pipe.step(batch, batch), repeats)
        theirs = _torch_pipelining_step(world, m, schedule, batch, repeats)
        rows.append(
            {
                "kind": "side by side",
                "p": world,
                "m": m,
                "schedule": schedule,
                "transfer": payload,
                "numel": cols,
                "sbp_torch_s": ours,
                "torch_pipelining_s": theirs,
                "ideal_s": ideal_step(schedule, world, m, 0.0),
            }
        )
    return rows


def _overlap_rows(world: int, m: int, schedule: str, numel: int, transfer_s: float, repeats: int) -> list[dict]:
    """Step times with fast transfers, with link-time transfers and with loopback payloads."""
    pipe = _pipeline(world, m, schedule)
    cases = {
        "fast": (4, contextlib.nullcontext),
        "link time": (4, lambda: _link_time(OVERLAP_SHARE * FORWARD_S)),
        "loopback payload": (numel, contextlib.nullcontext),
    }
    times = {}
    for name, (cols, context) in cases.items():
        batch = torch.ones(m, cols)
        with context():
            pipe.step(batch, batch)
            times[name] = statistics.median(_step_time(pipe, batch)[0] for _ in range(repeats))
    shares = {"link time": OVERLAP_SHARE, "loopback payload": transfer_s / FORWARD_S}
    return [
        {
            "kind": "overlap",
            "p": world,
            "m": m,
            "schedule": schedule,
            "transfer": name,
            "numel": numel,
            "share": shares[name],
            "forward_s": FORWARD_S,
            "fast_s": times["fast"],
            "slow_s": times[name],
            "increase": times[name] / times["fast"] - 1,
        }
        for name in shares
    ]


def stage_order(schedule: str, p: int, s: int, m: int) -> list[tuple[str, int]]:
    """The order stage ``s`` runs its forwards and backwards in, as the quota rule makes it: ``q`` forwards,
    then one backward and one forward while forwards are left, then the remaining backwards."""
    q = SCHEDULES[schedule](p, s, m)
    return (
        [("F", i) for i in range(q)]
        + [x for i in range(m - q) for x in (("B", i), ("F", q + i))]
        + [("B", i) for i in range(m - q, m)]
    )


def ideal_step(
    schedule: str, p: int, m: int, transfer_s: float, forward_s: float = FORWARD_S, backward_s: float = BACKWARD_S
) -> float:
    """The step time of ``schedule`` with no overhead at all: each stage runs its order (``stage_order``) as
    soon as its inputs are there, and every hand-over between stages takes ``transfer_s``."""
    end: dict = {}
    orders = [stage_order(schedule, p, s, m) for s in range(p)]
    done, free = [0] * p, [0.0] * p
    while any(done[s] < len(orders[s]) for s in range(p)):
        for s in range(p):
            while done[s] < len(orders[s]):
                kind, i = orders[s][done[s]]
                dep = (
                    (s - 1, "F", i) if kind == "F" and s > 0 else (s + 1, "B", i) if kind == "B" and s < p - 1 else None
                )
                if dep is not None and dep not in end:
                    break
                start = max(free[s], end[dep] + transfer_s if dep is not None else 0.0)
                free[s] = end[(s, kind, i)] = start + (forward_s if kind == "F" else backward_s)
                done[s] += 1
    return max(free)


def measure(world: int, quick: bool) -> list[dict]:
    rows = []
    repeats = 1 if quick else 3
    for name, (schedule, virtual) in SCHEDULE_ROWS.items():
        for m in [4, 8] if quick else [4, 8, 16, 32]:
            pipe = _pipeline(world, m, schedule, virtual)
            batch = torch.ones(m, 4)
            pipe.step(batch, batch)  # warm-up
            bubbles, peaks = [], {}
            for _ in range(repeats):
                span, timeline = _step_time(pipe, batch)
                bubbles.append(statistics.mean(1 - timeline.busy_fraction(r) for r in range(world)))
                gathered = [None] * world
                dist.all_gather_object(gathered, pipe.peak_activations)
                for stage, peak in (item for per_rank in gathered for item in per_rank.items()):
                    peaks[stage] = max(peak, peaks.get(stage, 0))
            rows.append(
                {
                    "kind": "bubble",
                    "p": world,
                    "m": m,
                    "schedule": name,
                    "bubble": statistics.median(bubbles),
                    "theory": (world - 1) / (virtual * m + world - 1),
                    "peak_activations": [peaks[s] for s in sorted(peaks)],
                }
            )
            if m == 8 and dist.get_rank() == 0 and schedule == "1f1b":
                suffix = "" if virtual == 1 else f"_interleaved{virtual}"
                timeline.write_png(
                    os.path.join(DOCS, f"pipeline_timeline_p{world}{suffix}.png"),
                    f"{name}, p={world}, m={m}: forward {FORWARD_S * 1e3:g} ms, "
                    f"backward {BACKWARD_S * 1e3:g} ms per micro-batch and rank",
                )
    numel = _calibrate(OVERLAP_SHARE * FORWARD_S)
    transfer_s = _transfer_seconds(numel)
    for schedule in ["gpipe", "1f1b"]:
        for m in [8] if quick else [8, 16]:
            rows += _overlap_rows(world, m, schedule, numel, transfer_s, repeats)
            rows += _side_by_side_rows(world, m, schedule, numel, repeats)
    return rows


def _ideal_increase(r: dict) -> float:
    """How much the schedule itself, run with no overhead, slows down with the row's transfers."""
    with_transfers = ideal_step(r["schedule"], r["p"], r["m"], r["share"] * FORWARD_S)
    return with_transfers / ideal_step(r["schedule"], r["p"], r["m"], 0) - 1


def report(rows: list[dict]) -> str:
    bubbles = [r for r in rows if r["kind"] == "bubble"]
    table = markdown_table(
        ["p", "m", "schedule", "bubble (measured)", "theory", "difference", "peak activations per stage"],
        [
            [
                r["p"],
                r["m"],
                r["schedule"],
                f"{r['bubble']:.3f}",
                f"{r['theory']:.3f}",
                f"{r['bubble'] - r['theory']:+.3f}",
                ", ".join(map(str, r["peak_activations"])),
            ]
            for r in bubbles
        ],
    )
    overlap = markdown_table(
        [
            "p",
            "m",
            "schedule",
            "transfer",
            "transfer / forward",
            "step, fast transfers",
            "step, slow transfers",
            "increase",
            "ideal schedule",
        ],
        [
            [
                r["p"],
                r["m"],
                r["schedule"],
                r["transfer"],
                f"{r['share']:.2f}",
                f"{r['fast_s'] * 1e3:.1f} ms",
                f"{r['slow_s'] * 1e3:.1f} ms",
                f"{r['increase'] * 100:+.1f}%",
                f"{_ideal_increase(r) * 100:+.1f}%",
            ]
            for r in rows
            if r["kind"] == "overlap"
        ],
    )
    side = markdown_table(
        [
            "p",
            "m",
            "schedule",
            "activations",
            "sbp_torch",
            "torch.distributed.pipelining",
            "sbp_torch / torch",
            "ideal schedule",
        ],
        [
            [
                r["p"],
                r["m"],
                r["schedule"],
                r["transfer"],
                f"{r['sbp_torch_s'] * 1e3:.1f} ms",
                f"{r['torch_pipelining_s'] * 1e3:.1f} ms",
                f"{r['sbp_torch_s'] / r['torch_pipelining_s']:.3f}",
                f"{r['ideal_s'] * 1e3:.0f} ms",
            ]
            for r in rows
            if r["kind"] == "side by side"
        ],
    )
    worst = max(abs(r["bubble"] - r["theory"]) for r in bubbles if SCHEDULE_ROWS[r["schedule"]][1] == 1)
    interleaved = [r for r in bubbles if SCHEDULE_ROWS[r["schedule"]][1] > 1]
    plain = {(r["p"], r["m"]): r["bubble"] for r in bubbles if r["schedule"] == "1f1b"}
    before = ", ".join(f"{plain[r['p'], r['m']]:.3f}" for r in interleaved)
    after = ", ".join(f"{r['bubble']:.3f}" for r in interleaved)
    return (
        f"Each rank's stages sleep {FORWARD_S * 1e3:g} ms forward and {BACKWARD_S * 1e3:g} ms backward per "
        f"micro-batch in all. Theory: `(p-1)/(m+p-1)`; with `v` interleaved virtual stages per rank (stage `g` "
        f"on rank `g mod p`, each taking `1/v` of the time), `(p-1)/(v m+p-1)`. Largest distance from theory "
        f"for GPipe and 1F1B: {worst:.3f} (target 0.05). Interleaving two stages per rank took 1F1B's bubble "
        f"from {before} to {after} (the rows in order); it stays further from "
        f"its theory because every micro-batch crosses twice as many hand-overs, each 1 to 2 ms "
        f"here.\n\n{table}\n\n"
        f"Transfer overlap (target: < 10% longer steps when each transfer takes 0.3 of a forward): the step "
        f"with every activation and gradient taking the share of a forward in the fifth column, against the "
        f"same step with tiny tensors. *link time* transfers wait that long on their lane and take no CPU "
        f"(a copy engine); *loopback payloads* are tensors whose gloo send takes that long, CPU copies on "
        f"the 2 cores the ranks share. The last column is the increase of the same schedule run with no "
        f"overhead at all (`ideal_step`: each stage runs its quota order as soon as its inputs are there): "
        f"what any scheduler keeping that order would show. 1F1B cannot meet the target: with at most `p` "
        f"micro-batches in flight on stage 0, each round trip to the last stage waits for `2 (p - 1)` "
        f"transfers, so every micro-batch costs stage 0 at least `2 (p - 1) t / p` more.\n\n{overlap}\n\n"
        f"Side by side with PyTorch's own pipeline API, `torch.distributed.pipelining` (the same stages, one "
        f"per rank, its `ScheduleGPipe` and `Schedule1F1B`): the wall time of a training step, from a barrier "
        f"to the slowest rank's return, with tiny activations and with the loopback payloads above (the "
        f"medians of the runs).\n\n{side}\n\n"
        "1F1B timelines (m = 8), drawn by `Pipeline.timeline().write_png`:\n\n"
        "![p=2](pipeline_timeline_p2.png)\n\n![p=4](pipeline_timeline_p4.png)\n\n"
        "Two interleaved stages per rank (1F1B quotas over all the stages):\n\n"
        "![p=2, interleaved](pipeline_timeline_p2_interleaved2.png)\n\n"
        "![p=4, interleaved](pipeline_timeline_p4_interleaved2.png)\n"
    )


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ms = sorted({r["m"] for r in rows if r["kind"] == "bubble"})
    for p, color in [(2, "#4c72b0"), (4, "#dd8452")]:
        for schedule, marker in zip(SCHEDULE_ROWS, ["o", "x", "^"]):
            pts = [r for r in rows if r["kind"] == "bubble" and r["p"] == p and r["schedule"] == schedule]
            ax.plot([r["m"] for r in pts], [r["bubble"] for r in pts], marker, color=color, label=f"p={p} {schedule}")
        for v, style in [(1, "-"), (2, ":")]:
            ax.plot(
                ms,
                [(p - 1) / (v * m + p - 1) for m in ms],
                style,
                color=color,
                alpha=0.5,
                label=f"p={p} theory" + (f", v={v}" if v > 1 else ""),
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble fraction")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
