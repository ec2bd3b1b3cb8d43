"""Pipelines on CUDA: do stage transfers, staged through pinned memory on their own copy streams, hide behind
compute? (Needs a GPU; two ranks may share one.)

Each stage is one rank whose forward and backward keep the GPU busy for ``FORWARD_S`` / ``BACKWARD_S`` with a
one-block spin kernel (``torch.cuda._sleep``), so stages are equal, take a fixed time, and leave the copy
engines and all but one multiprocessor free, like a memory-light stage. The host only queues that work, so
the actor loop runs ahead of the GPU as it does in real training.

The step time (host wall clock, from a barrier to the step's return, which waits for the GPU) is measured
with tiny activations and with activations whose transfer (device to pinned host memory, gloo over loopback,
pinned memory to device, timed alone) takes ``OVERLAP_SHARE`` of a forward; the increase is compared with
the schedule's own lower bound for such transfers (``pipeline.ideal_step``, no overhead at all).

Two processes on one GPU are time-sliced unless the CUDA MPS daemon runs (``scripts/gpu.sh`` starts it where
it can); the report says which.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import sbp_torch as st
from benchmarks.harness import markdown_table
from benchmarks.suites.pipeline import ideal_step, wall_samples
from sbp_torch.pipeline import Pipeline

TITLE = "Pipelines on CUDA: stage transfers beside compute"
WORLDS = [2]
NEEDS_CUDA = True
COMMAND = "scripts/gpu.sh pipeline"  # runs the suite without and with MPS and keeps both
FORWARD_S, BACKWARD_S = 0.01, 0.01
OVERLAP_SHARE = 0.3
_cycles_per_second = None


def _spin(seconds: float) -> None:
    """Keep the current stream busy for about ``seconds`` with one spinning block."""
    torch.cuda._sleep(int(seconds * _cycles_per_second))


def _calibrate_spin() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # warm-up
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


class _Spin(torch.autograd.Function):
    """Spins forward and backward; passes its input on, or, given ``width``, makes the activation ``width``
    wide (the first stage: a small batch of inputs becomes large activations, as token ids become hidden
    states, so that only stage transfers carry payloads)."""

    @staticmethod
    def forward(ctx, x, scale, width):
        ctx.shape = x.shape if width else None
        _spin(FORWARD_S)
        return x.new_zeros(x.shape[0], width) if width else x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _spin(BACKWARD_S)
        return (g.new_zeros(ctx.shape) if ctx.shape is not None else g), None, None


class SpinStage(nn.Module):
    def __init__(self, width: int = 0):
        super().__init__()
        self.scale, self.width = nn.Parameter(torch.ones(())), width

    def forward(self, x):
        return _Spin.apply(x, self.scale, self.width)


def _loss(y, t):
    return y.reshape(-1)[0]


def _transfer_seconds(numel: int, repeats: int = 7) -> float:
    """Median one-way time of a staged transfer of ``numel`` float32 from rank 0's GPU to rank 1's."""
    dev = torch.ones(numel, device="cuda")
    host = torch.empty(numel, pin_memory=True)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        if dist.get_rank() == 0:
            host.copy_(dev, non_blocking=True)
            torch.cuda.current_stream().synchronize()
            dist.send(host, 1)
            dist.recv(host[:1], 1)  # rank 1's copy is done
        elif dist.get_rank() == 1:
            dist.recv(host, 0)
            dev.copy_(host, non_blocking=True)
            torch.cuda.current_stream().synchronize()
            dist.send(host[:1], 0)
        times.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _calibrate_payload(target_s: float) -> int:
    """Elements per activation whose staged transfer takes ``target_s`` (within 5%, or the closest of 10 tries;
    each rank computes the same from the same all-reduced times)."""
    numel, best = 1 << 21, None
    for _ in range(10):
        took = _transfer_seconds(numel)
        if best is None or abs(took - target_s) < abs(best[1] - target_s):
            best = numel, took
        if abs(took - target_s) < 0.05 * target_s:
            break
        numel = max(1024, int(numel * target_s / max(took, 1e-6)))
    return best[0]


def _mps_running() -> bool:
    """Whether an MPS control daemon listens (its pipe, where CUDA clients look for it)."""
    return os.path.exists(os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), "control"))


def measure(world: int, quick: bool) -> list[dict]:
    global _cycles_per_second
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    _cycles_per_second = _calibrate_spin()
    numel = _calibrate_payload(OVERLAP_SHARE * FORWARD_S)
    transfer_s = _transfer_seconds(numel)
    repeats = 3 if quick else 7
    rows = []
    for schedule in ["gpipe", "1f1b"]:
        for m in [8] if quick else [8, 16]:
            times = {}
            for name, width in [("tiny", 4), ("payload", numel)]:
                stages = [SpinStage(width if r == 0 else 0).to_global(st.placement("cuda", [r])) for r in range(world)]
                pipe = Pipeline(stages, _loss, m, schedule)
                batch = torch.ones(m, 1)
                pipe.step(batch, batch)  # warm-up
                torch.cuda.synchronize()  # each sample then ends with the GPU idle, as it starts

                def step():
                    pipe.step(batch, batch)
                    torch.cuda.synchronize()

                samples = wall_samples(step, repeats)
                times[name] = (statistics.median(samples), min(samples), max(samples))
            rows.append(
                {
                    "p": world,
                    "m": m,
                    "schedule": schedule,
                    "numel": numel,
                    "transfer_s": transfer_s,
                    "share": transfer_s / FORWARD_S,
                    "tiny": times["tiny"],
                    "payload": times["payload"],
                    "ideal_tiny": ideal_step(schedule, world, m, 0.0, FORWARD_S, BACKWARD_S),
                    "ideal_payload": ideal_step(schedule, world, m, transfer_s, FORWARD_S, BACKWARD_S),
                    "device": torch.cuda.get_device_name(),
                    "mps": _mps_running(),
                    "forward_s": FORWARD_S,
                }
            )
    return rows


def report(rows: list[dict]) -> str:
    """One table per run (``scripts/gpu.sh`` runs the suite without and with MPS and keeps both)."""
    parts = []
    for mps in sorted({r["mps"] for r in rows}):
        run = [r for r in rows if r["mps"] == mps]
        first = run[0]
        table = markdown_table(
            [
                "p",
                "m",
                "schedule",
                "transfer / forward",
                "step, tiny activations",
                "step, payload",
                "increase",
                "ideal schedule: step, increase",
            ],
            [
                [
                    r["p"],
                    r["m"],
                    r["schedule"],
                    f"{r['share']:.2f}",
                    f"{r['tiny'][0] * 1e3:.1f} ms ({r['tiny'][1] * 1e3:.1f}-{r['tiny'][2] * 1e3:.1f})",
                    f"{r['payload'][0] * 1e3:.1f} ms ({r['payload'][1] * 1e3:.1f}-{r['payload'][2] * 1e3:.1f})",
                    f"{(r['payload'][0] / r['tiny'][0] - 1) * 100:+.1f}%",
                    f"{r['ideal_tiny'] * 1e3:.0f} ms, {(r['ideal_payload'] / r['ideal_tiny'] - 1) * 100:+.1f}%",
                ]
                for r in run
            ],
        )
        sharing = (
            "the two ranks run their kernels side by side, as on two GPUs"
            if mps
            else "the two ranks time-slice the GPU"
        )
        parts.append(
            f"**CUDA MPS {'on' if mps else 'off'}** ({sharing}). "
            f"Device: {first['device']}. Each stage spins "
            f"{first['forward_s'] * 1e3:g} ms forward and as long backward per micro-batch; a payload activation "
            f"is {first['numel']} float32 ({first['numel'] * 4 / 2**20:.1f} MiB), whose staged transfer alone "
            f"takes {first['transfer_s'] * 1e3:.2f} ms. Step times: median (min-max) of the runs.\n\n{table}\n"
        )
    return "\n".join(parts)
