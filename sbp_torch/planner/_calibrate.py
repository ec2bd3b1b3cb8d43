"""Calibration: the constants of a ``CostModel`` measured on the machine and process group at hand.

Each constant is the median of a few timed repetitions of one small benchmark after a warm-up: a square matmul
per dtype family (FLOP/s), an out-of-place add (memory bandwidth), an eager global op against its plain local op
(host overhead), and all-reduces of two sizes (the link's latency and bandwidth)."""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from .._api import ones
from .._layout import Placement
from ..sbp import broadcast
from ._cost_model import COLLECTIVE_RULES, CPU_GLOO, CostModel, Link
from ._counting import CountOps

# Per device type: the side of the square matmul and the elements of each float32 operand of the add (16 MB on a
# CPU, 256 MB on a GPU): large enough that a run takes milliseconds and a GPU reaches its peaks.
_SIZES = {"cpu": (512, 4 << 20), "cuda": (4096, 64 << 20)}
_LINK_BYTES = (4 << 10, 4 << 20)  # all-reduces the link is fitted to: one latency-bound, one bandwidth-bound
_MIN_LATENCY_S = 1e-6  # a fit may come out at or below zero; a free collective would mislead the planner


def calibrate(placement: Placement | None = None, *, repeats: int = 5) -> CostModel:
    """Measure the constants of a ``CostModel`` on this machine and process group.

    Every rank of the default process group must call it: it runs collectives. Every rank returns the same
    model, the numbers measured on the placement's first rank. Without a process group it measures the local
    constants only and takes ``op_overhead_s`` and the links from ``CPU_GLOO``; a placement of one rank takes
    the links from ``CPU_GLOO`` too (a group of one never uses them).

    Only one host is measured: ``intra`` and ``inter`` are both the link fitted to all-reduces over the
    placement's ranks, and ``ranks_per_node`` is the world size. On a multi-node job give the real figures:
    ``calibrate().with_(ranks_per_node=8, inter=Link(2e-5, 4.5e10))``.

    The peaks are what real ops reach under this process's settings (threads, TF32), so ``efficiency`` is 1.0.
    ``overlap`` is 0.8 on CUDA and 0.0 on CPU, where ranks share the cores that would hide communication.
    ``memory_per_rank`` is the GPU's total memory, or unbounded on CPU.

    Args:
        placement: the ranks and device type to measure; by default every rank of the default group, on CUDA
            if its backend is NCCL, else on CPU.
        repeats: timed repetitions per measurement, after one untimed one; each constant is their median.

    Returns:
        The calibrated ``CostModel``, named after the world it was measured on.

    Example::

        model = sbp_torch.planner.calibrate()  # on every rank
        print(model.to_json())
    """
    grouped = dist.is_initialized()
    world = dist.get_world_size() if grouped else 1
    backend = dist.get_backend() if grouped else "no process group"
    if placement is None:
        placement = Placement("cuda" if "nccl" in backend else "cpu", list(range(world)))
    device = placement.device()

    side, elements = _SIZES[placement.type]
    values = [
        _matmul_flops(side, torch.float32, device, repeats),
        _matmul_flops(side, torch.bfloat16, device, repeats),
        _memory_bandwidth(elements, device, repeats),
        _op_overhead_s(placement, device, repeats) if grouped else CPU_GLOO.op_overhead_s,
        *_link_values(placement, world, device, repeats),
    ]
    if world > 1:
        values = _agree(values, placement.flat_ranks[0], device)
    flops_float, flops_half, bandwidth, overhead, latency_s, link_bandwidth = values
    link = Link(latency_s, link_bandwidth)
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else float("inf")
    return CostModel(
        name=f"calibrated on {world} {placement.type} rank{'s' if world > 1 else ''} ({backend})",
        flops={"float": flops_float, "half": flops_half},
        memory_bandwidth=bandwidth,
        efficiency=1.0,
        op_overhead_s=overhead,
        intra=link,
        inter=link,
        ranks_per_node=world,
        overlap=0.8 if device.type == "cuda" else 0.0,
        optimizer_foreach=device.type == "cuda",
        memory_per_rank=memory,
    )


def _median_s(run, repeats: int, device: torch.device, calls: int = 1, align=None) -> float:
    """Median seconds of one call of ``run`` over ``repeats`` timed repetitions of ``calls`` calls, after one
    untimed repetition (first calls pay for lazy imports and caches); ``align`` runs before each, off the clock."""
    times = []
    for _ in range(repeats + 1):
        if align is not None:
            align()
        _synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            run()
        _synchronize(device)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times[1:])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":  # kernels run asynchronously: the clock must wait for them
        torch.cuda.synchronize(device)


def _matmul_flops(side: int, dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    a = torch.randn(side, side, dtype=dtype, device=device)
    b = torch.randn(side, side, dtype=dtype, device=device)
    return 2 * side**3 / _median_s(lambda: a @ b, repeats, device)


def _memory_bandwidth(elements: int, device: torch.device, repeats: int) -> float:
    a = torch.randn(elements, device=device)
    b = torch.randn(elements, device=device)
    return 3 * a.nbytes / _median_s(lambda: a + b, repeats, device)  # two operands read, the sum written


def _op_overhead_s(placement: Placement, device: torch.device, repeats: int) -> float:
    """The host seconds a global op adds to its local op inside a training step (autograd, module hooks, the
    dispatcher): a small laid-out MLP's forward and backward against the same on plain tensors, divided by the
    global ops the step ran. Nothing is split, so no collective runs."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 8)).to(device)
    laid_out = copy.deepcopy(plain).to_global(placement, broadcast)
    x = torch.ones(4, 8, device=device)
    x_global = ones(4, 8, placement=placement, sbp=broadcast)

    def step(model, inputs):
        def run():
            model(inputs).sum().backward()

        return run

    ops: list = []
    with CountOps(ops):
        step(laid_out, x_global)()
    global_s = _median_s(step(laid_out, x_global), repeats, device)
    local_s = _median_s(step(plain, x), repeats, device)
    return max(global_s - local_s, 0.0) / max(len(ops), 1)


def _link_values(placement: Placement, world: int, device: torch.device, repeats: int) -> tuple[float, float]:
    """(latency, bandwidth) fitted to all-reduces over the placement's ranks, on the ranks that hold it."""
    ranks = sorted(placement.flat_ranks)
    if len(ranks) == 1:
        return CPU_GLOO.intra.latency_s, CPU_GLOO.intra.bandwidth
    group = None if len(ranks) == world else dist.new_group(ranks)  # every rank of the world enters new_group
    if dist.get_rank() not in ranks:
        return 0.0, 0.0  # not used: every rank takes the placement's first rank's numbers
    steps, factor = (rule(len(ranks)) for rule in COLLECTIVE_RULES["all-reduce"])
    flag = torch.zeros(1, device=device)

    def align():  # the ranks start each call together: no rank's lag on the clock
        dist.all_reduce(flag, group=group)

    times = []
    for nbytes in _LINK_BYTES:
        buffer = torch.zeros(nbytes // 4, device=device)  # zeros: repeated sums stay finite
        # One call per repetition: a step's collectives come one at a time between ops, and back-to-back gloo
        # calls took up to five times one call's time on a two-core host.
        times.append(_median_s(lambda: dist.all_reduce(buffer, group=group), repeats, device, align=align))
    (small, large), (small_s, large_s) = _LINK_BYTES, times
    # Two points fix the line time = latency + factor * bytes / bandwidth; when noise makes the larger call no
    # slower, the larger call's time is all bandwidth.
    bandwidth = factor * (large - small) / (large_s - small_s) if large_s > small_s else factor * large / large_s
    return max((small_s - factor * small / bandwidth) / steps, _MIN_LATENCY_S), bandwidth  # latency per step


def _agree(values: list[float], src: int, device: torch.device) -> list[float]:
    """Rank ``src``'s values on every rank: ranks measure apart and differ a little, but a plan needs one model."""
    values = torch.tensor(values, dtype=torch.float64, device=device)
    dist.broadcast(values, src)
    return values.tolist()
