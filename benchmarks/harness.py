"""What every benchmark suite shares: launching ranks, timing, statistics and writing results.

A suite is a module of ``benchmarks/suites`` with

* ``TITLE``: the heading of its page, ``WORLDS``: the world sizes it runs on (each a torchrun launch),
* ``measure(world: int, quick: bool) -> list[dict]``: run on every rank, returns rows (rank 0's are kept),
* ``report(rows: list[dict]) -> str``: the markdown under the heading of ``docs/benchmarks/<suite>.md``
  (the runner adds the machine line and the plot), and optionally ``plot(rows, path)``: a PNG.

``python -m benchmarks.run --suite NAME`` launches the ranks (``torchrun``), gathers rows into
``docs/benchmarks/<suite>.json`` and writes the markdown table and plot next to it. ``DOCS`` is that folder:
everything a benchmark writes, suite or script, goes there.

Timing: ``timed(fn)`` runs ``fn`` after warm-up, ``repeats`` times, with all ranks starting each repetition
together (a barrier outside the timed region) and each repetition's time being the slowest rank's, since
a collective step is as slow as its slowest rank. Results are medians with the interquartile range.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks")


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
