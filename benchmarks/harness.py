"""What every benchmark suite shares: launching ranks, timing, statistics and writing results.

A suite is a module of ``benchmarks/suites`` with

* ``TITLE``: the heading of its page, ``WORLDS``: the world sizes it runs on (each a torchrun launch),
* ``measure(world: int, quick: bool) -> list[dict]``: run on every rank, returns rows (rank 0's are kept),
* ``report(rows: list[dict]) -> str``: the markdown under the heading of ``docs/benchmarks/<suite>.md``
  (the runner adds the machine line and the plot), and optionally ``plot(rows, path)``: a PNG.

``python -m benchmarks.run --suite NAME`` launches the ranks (``torchrun``), gathers rows into
``docs/benchmarks/<suite>.json`` and writes the markdown table and plot next to it. ``DOCS`` is that folder:
everything a benchmark (suite or script) or a diagnostic (``diagnostics/``) writes goes there.

Timing: ``timed(fn)`` runs ``fn`` after warm-up, ``repeats`` times, with all ranks starting each repetition
together (a barrier outside the timed region) and each repetition's time being the slowest rank's, since
a collective step is as slow as its slowest rank. Results are medians with the interquartile range.
``timed_interleaved`` times several steps taking turns, so that their ratio holds on a loaded machine.

What suites share lives here once, and no suite imports another's private helpers: timers (``timed``,
``timed_local``, ``timed_interleaved``, ``per_call_us``), the measured code and machine load (``code_state``,
``load_note``), cell formatting (``fmt``, ``ratio``, ``fmt_rate``, ``rate_ratio``), layout names and meshes
(``LAYOUT_NAMES``, ``meshes``, ``RankGrid``, the ``sbp``/``dtensor_placement`` of a layout token), training steps that
may fail (``Guarded``, ``train_in_turns``) and the profiled peak memory.
"""

from __future__ import annotations

import itertools
import math
import os
import platform
import statistics
import subprocess
import time
import traceback

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, "docs", "benchmarks")
# How tables name the 4-rank layouts; the zoo calls its 2-D layout "2d", the GPT suites "dp_tp".
LAYOUT_NAMES = {"dp": "DP (4)", "tp": "TP (4)", "dp_tp": "DP x TP (2x2)", "2d": "DP x TP (2x2)"}
MEASURED = "measured step"  # the record_function name of the step peak_memory reads


def timed(fn, repeats: int = 50, warmup: int = 5, sync=None) -> dict:
    """Median and spread (µs) of ``fn()`` over ``repeats`` runs; each run's time is the slowest rank's.

    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before each clock read when work is asynchronous.
    """
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        if sync:
            sync()
        start = time.perf_counter_ns()
        fn()
        if sync:
            sync()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    slowest = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return summary(slowest.tolist())


def timed_local(fn, repeats: int = 200, warmup: int = 10, sync=None) -> dict:
    """Like ``timed`` but for work with no collective inside: no barrier per run, this rank's clock only."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if sync:
            sync()
        start = time.perf_counter_ns()
        fn()
        if sync:
            sync()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    return summary(samples)


def per_call_us(fn, calls: int, rounds: int, warmup: int) -> float:
    """µs per call of ``fn``, in this process alone, for a call too short to time by itself: the median over ``rounds``
    rounds of ``calls`` calls each, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def summary(samples: list[float]) -> dict:
    """Median, quartiles and count of timings in µs."""
    if len(samples) < 2:
        return {"median_us": samples[0], "q1_us": samples[0], "q3_us": samples[0], "n": len(samples)}
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return {"median_us": statistics.median(samples), "q1_us": q1, "q3_us": q3, "n": len(samples)}


def fmt(stat: dict | None, unit: str = "us") -> str:
    """``median (q1-q3)`` in µs or ms for a markdown cell; an em dash when not measured."""
    if not stat:
        return "—"
    scale, suffix = (1e3, " ms") if unit == "ms" else (1.0, "")
    return f"{stat['median_us'] / scale:.1f} ({stat['q1_us'] / scale:.1f}–{stat['q3_us'] / scale:.1f}){suffix}"


def ratio(a: dict | None, b: dict | None) -> str:
    """``a``'s median over ``b``'s, for a markdown cell."""
    if not a or not b or not b["median_us"]:
        return "—"
    return f"{a['median_us'] / b['median_us']:.2f}x"


def rate_ratio(a: dict | None, b: dict | None) -> str:
    """How many times ``b``'s step time ``a``'s is (``a``'s speed-up over ``b``), for rows that hold their step
    statistics under ``"step"``; an em dash when either is missing."""
    return ratio((b or {}).get("step"), (a or {}).get("step"))


def machine() -> str:
    """One line naming the machine and versions the numbers come from."""
    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"CPU ({platform.processor() or platform.machine()})"
    )
    return f"{device}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def timed_interleaved(fns: dict, repeats: int, warmup: int) -> dict[str, dict]:
    """``harness.timed`` for several functions at once, taking turns: name -> median and quartiles (µs).

    On a shared machine the load drifts; taking turns (one call of each per round) gives every function the
    same conditions, so their ratio holds even when the absolute times move. Each call starts after a
    barrier and counts as the slowest rank's time.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples = torch.zeros(len(fns), repeats, dtype=torch.float64)
    for r in range(repeats):
        for i, fn in enumerate(fns.values()):
            dist.barrier()
            start = time.perf_counter_ns()
            fn()
            samples[i, r] = (time.perf_counter_ns() - start) / 1e3
    dist.all_reduce(samples, op=dist.ReduceOp.MAX)
    return {name: summary(samples[i].tolist()) for i, name in enumerate(fns)}


def code_state() -> str:
    """The commit measured, marked when ``sbp_torch/`` had uncommitted changes (work in progress)."""

    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    dirty = " + uncommitted changes in sbp_torch/" if git("status", "--porcelain", "sbp_torch") else ""
    return (git("rev-parse", "--short", "HEAD") or "unknown") + dirty


def load_note(rows: list[dict]) -> str:
    """A sentence giving the machine's 1-minute load average after each measurement."""
    loads = [r["load"] for r in rows if "load" in r]
    if not loads:
        return ""
    return (
        f"1-minute load average of the machine after each measurement: {min(loads):.1f} to {max(loads):.1f} "
        f"({os.cpu_count()} cores); above the number of ranks means other jobs shared the cores."
    )


def steps_per_second(stat: dict) -> tuple[float, float, float]:
    """(median, low, high) steps/s from step-time statistics (the slow quartile gives the low rate)."""
    return 1e6 / stat["median_us"], 1e6 / stat["q3_us"], 1e6 / stat["q1_us"]


def fmt_rate(stat: dict | None) -> str:
    """Steps per second, ``median (low–high)`` from step-time statistics, for a markdown cell."""
    if not stat:
        return "—"
    mid, low, high = steps_per_second(stat)
    return f"{mid:.1f} ({low:.1f}–{high:.1f})"


def threads(n) -> str:
    """``1 thread``, ``2 threads``."""
    return f"{n} thread" + ("" if n == 1 else "s")


def relative_difference(got: list[float], want: list[float]) -> float:
    """The largest of ``|got - want| / |want|`` over paired values (losses step by step)."""
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


def meshes(world: int) -> list[tuple[int, ...]]:
    """The mesh shapes a suite runs on ``world`` ranks: 1-D, and 2x2 on 4."""
    return [(world,)] if world != 4 else [(4,), (2, 2)]


class RankGrid:
    """The ranks of a mesh of ``shape``, row-major (``(2, 2)``: ranks ``[[0, 1], [2, 3]]``), as both libraries hold
    them: sbp_torch's ``placement`` and DTensor's ``mesh``; this rank's ``coord`` on them, and the ``name`` tables
    give the mesh (``"2x2"``)."""

    def __init__(self, shape: tuple[int, ...]):
        from torch.distributed.device_mesh import init_device_mesh

        import sbp_torch as st

        self.shape = shape
        self.name = "x".join(map(str, shape))
        self.placement = st.placement("cpu", torch.arange(math.prod(shape)).view(shape).tolist())
        self.mesh = init_device_mesh("cpu", shape)
        self.coord = list(itertools.product(*(range(n) for n in shape)))[dist.get_rank()]


def sbp(token: str):
    """The sbp_torch SBP a layout token names: ``B``, ``S<dim>``, ``P`` (partial sum), ``Pmax``."""
    from sbp_torch.sbp import broadcast, partial_max, partial_sum, split

    return {"B": broadcast, "P": partial_sum, "Pmax": partial_max}.get(token) or split(int(token[1:]))


def dtensor_placement(token: str):
    """The DTensor placement of the same layout token."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if token == "B":
        return Replicate()
    if token.startswith("P"):
        return Partial("max" if token == "Pmax" else "sum")
    return Shard(int(token[1:]))


def first_line(err: BaseException, here: str) -> str:
    """The error's type and first line, and the innermost frame outside torch that raised it (model code); a frame
    of the file ``here`` (the caller's step) is named by its line of code."""
    text = str(err).strip().splitlines()
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f"{os.sep}torch{os.sep}" not in f.filename]
    if not frames:
        where = ""
    elif os.path.abspath(frames[-1].filename) == os.path.abspath(here):  # in the step itself: say which call
        where = f" (in `{frames[-1].line}`)"
    else:
        where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})"
    return f"{type(err).__name__}: {text[0] if text else ''}".strip() + where


class Guarded:
    """A training step that stops at its first exception: the error is kept and later calls do nothing."""

    def __init__(self, make_step, here: str):
        self.error: str | None = None
        self.here = here
        self.losses: list[float] = []
        try:
            self.step = make_step()
        except Exception as err:
            self.error = first_line(err, self.here)

    def __call__(self, batch: dict) -> None:
        if self.error is None:
            try:
                self.losses.append(self.step(batch))
            except Exception as err:
                self.error = first_line(err, self.here)

    def agree(self) -> None:
        """Make every rank see a failure of any rank (the message of the lowest rank that failed)."""
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, self.error)
        self.error = next((e for e in errors if e is not None), None)


def train_in_turns(
    steps: dict[str, Guarded], batches, warmup: int, repeats: int
) -> dict[str, tuple[dict | None, Guarded]]:
    """Warm up and time the guarded steps, taking turns; a variant that fails on any rank drops out (no time)."""
    feeds = {name: iter(batches) for name in steps}
    for guarded in steps.values():
        guarded.agree()
    for _ in range(warmup):  # by hand, to agree on failures after each step
        for name, guarded in steps.items():
            if guarded.error is None:
                guarded(next(feeds[name]))
                guarded.agree()
    running = {name: guarded for name, guarded in steps.items() if guarded.error is None}
    stats = timed_interleaved(
        {name: (lambda g=guarded, f=feeds[name]: g(next(f))) for name, guarded in running.items()}, repeats, 0
    )
    for guarded in running.values():
        guarded.agree()
    return {name: (stats.get(name) if guarded.error is None else None, guarded) for name, guarded in steps.items()}


def _allocations(nodes):
    """The allocation events of a profiler event tree (nested under the ops that made them), depth first."""
    for node in nodes:
        if isinstance(node.extra_fields, torch._C._profiler._ExtraFields_Allocation):
            yield node
        yield from _allocations(node.children)


def peak_memory(prof) -> dict:
    """Bytes held (allocated minus freed since profiling began) at the start of the step profiled under
    ``record_function(MEASURED)``, its peak and its end.

    The profiler sees allocations and frees only on threads it profiles, and a block allocated there may be freed
    on another (a collective's worker thread releasing the last reference): its free is missing. Such a block is
    counted as freed when its address is handed out again, at the latest; a free of a block allocated before
    profiling began is ignored."""
    tree = prof.profiler.kineto_results.experimental_event_tree()
    window = next(e for e in prof.profiler.kineto_results.events() if e.name() == MEASURED)
    start, end = window.start_ns(), window.end_ns()
    live: dict[int, int] = {}  # address -> bytes
    held, at_start, peak = 0, None, 0
    for node in sorted(_allocations(tree), key=lambda n: n.start_time_ns):
        if node.start_time_ns > end:
            break
        if at_start is None and node.start_time_ns >= start:
            at_start = peak = held
        fields = node.extra_fields
        held -= live.pop(fields.ptr, 0)  # a free, or a new block where a block whose free went unseen was
        if fields.alloc_size > 0:
            live[fields.ptr] = fields.alloc_size
            held += fields.alloc_size
        if node.start_time_ns >= start:
            peak = max(peak, held)
    return {"at_step_start": held if at_start is None else at_start, "peak": max(peak, held), "at_step_end": held}
