"""The cost model: what a collective, an op and a step cost on some machine, as data with named constants.

Communication is priced per collective as ``steps * latency + factor * bytes / bandwidth`` on the link its
group spans (within a node or across nodes), where ``steps`` are the messages in sequence a ring algorithm
needs and ``factor`` what it moves per byte a rank puts in (``COLLECTIVE_RULES``). Compute is priced per op
by the roofline: the larger of its FLOPs against the peak of its dtype and its bytes against memory
bandwidth, both at ``efficiency``, plus the host's time per op (``op_overhead_s``: the Python of an eager
global op). Parameter collectives (gradient reductions, sharded gathers) run beside compute: ``overlap`` is
the fraction of their time compute hides."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace

import torch

from .._boxing import POINT_TO_POINT as SEND_RECV
from .._comm import POINT_TO_POINT as EXCHANGE


@dataclass(frozen=True)
class Link:
    """One kind of connection between ranks: seconds per message step of a collective, and bytes per second."""

    latency_s: float
    bandwidth: float


# Collective kind prefix (as ``sbp_torch.explain`` names it) -> (the messages in sequence a ring algorithm needs,
# the bytes it moves per byte a rank puts in), as functions of the group size n: a ring all-reduce takes 2(n-1)
# steps and moves each byte twice; an all-gather sends its part n-1 times.
COLLECTIVE_RULES = {
    "all-reduce": (lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),
    "reduce-scatter": (lambda n: n - 1, lambda n: (n - 1) / n),
    "all-gather": (lambda n: n - 1, lambda n: n - 1),
    "all-to-all": (lambda n: n - 1, lambda n: (n - 1) / n),
    "broadcast": (lambda n: math.ceil(math.log2(n)), lambda n: 1.0),
    # the bytes a rank sends to the ranks that need them; as the comm layer names it, and as a boxing plan does
    EXCHANGE: (lambda n: 1, lambda n: 1.0),
    SEND_RECV: (lambda n: 1, lambda n: 1.0),
}


def _rule(kind: str):
    for prefix, rule in COLLECTIVE_RULES.items():
        if kind.startswith(prefix):
            return rule
    raise ValueError(f"no cost rule for the collective {kind!r}")


_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class CostModel:
    """Constants of one machine type; ``sbp_torch.planner.calibrate`` measures them where the job runs.

    Args:
        name: what the constants describe.
        flops: peak FLOP/s per rank by dtype family: ``"half"`` (bf16, fp16) and ``"float"`` (everything else).
        memory_bandwidth: bytes/s per rank for memory-bound ops.
        efficiency: the fraction of the peaks real ops reach.
        op_overhead_s: host seconds per eager global op (dispatch); 0 for a compiled step.
        intra, inter: the links within a node and across nodes.
        ranks_per_node: how many consecutive ranks share a node.
        overlap: the fraction of parameter-collective time hidden behind compute.
        memory_per_rank: bytes a rank has for the step (the default limit ``plan`` checks against).
        optimizer_foreach: the optimizer makes each elementwise pass over all parameters in one call (torch's
            default on CUDA), not one call per parameter (its default on CPU).
    """

    name: str
    flops: dict = field(default_factory=dict)
    memory_bandwidth: float = 1e11
    efficiency: float = 0.6
    op_overhead_s: float = 0.0
    intra: Link = Link(2e-6, 1e11)
    inter: Link = Link(5e-6, 1e10)
    ranks_per_node: int = 8
    overlap: float = 0.0
    memory_per_rank: float = float("inf")
    optimizer_foreach: bool = False

    def link(self, ranks) -> Link:
        """The link a group of ``ranks`` communicates over."""
        return self.intra if len({r // self.ranks_per_node for r in ranks}) == 1 else self.inter

    def collective_s(self, kind: str, ranks, nbytes: int) -> float:
        """Seconds one collective ``kind`` takes in the group ``ranks`` when each rank puts in ``nbytes``."""
        if len(ranks) <= 1:
            return 0.0
        factor = _rule(kind)[1](len(ranks))
        return self.latency_s(kind, ranks) + factor * nbytes / self.link(ranks).bandwidth

    def latency_s(self, kind: str, ranks) -> float:
        """The part of a collective's time that does not depend on its bytes: its steps times the link's."""
        return _rule(kind)[0](len(ranks)) * self.link(ranks).latency_s if len(ranks) > 1 else 0.0

    def op_s(self, flops: float, nbytes: float, dtype: torch.dtype) -> float:
        """Seconds of one op on one rank: the roofline of its FLOPs and bytes, plus the host's overhead."""
        peak = self.flops.get("half" if dtype in _HALF else "float", 1e12)
        return self.op_overhead_s + max(flops / peak, nbytes / self.memory_bandwidth) / self.efficiency

    def for_step(self, compiled: bool) -> CostModel:
        """The constants for the step that runs: an eager step pays ``op_overhead_s`` per op (the dispatcher's
        Python); a compiled step (``compile_step``: one program of local ops and collectives) pays no host time per
        op, its optimizer included."""
        if not compiled:
            return self
        return replace(self, op_overhead_s=0.0)

    def with_(self, **changes) -> CostModel:
        """A copy with some constants changed: ``H100.with_(ranks_per_node=4)``."""
        return replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> CostModel:
        data = json.loads(text)
        return cls(**{**data, "intra": Link(**data["intra"]), "inter": Link(**data["inter"])})


# Published peaks (dense, per GPU) and typical NCCL bus bandwidths; the host overhead is our eager dispatcher's
# order of magnitude. A node is 8 GPUs on NVLink; nodes talk over one 400 Gb/s (H100) or 200 Gb/s (A100) NIC per GPU.
H100 = CostModel(
    name="H100 SXM node (NVLink 4, 400 Gb/s InfiniBand per GPU)",
    flops={"half": 989e12, "float": 67e12},
    memory_bandwidth=3.35e12,
    efficiency=0.6,
    op_overhead_s=3e-5,
    intra=Link(2e-6, 3.6e11),
    inter=Link(5e-6, 4.5e10),
    ranks_per_node=8,
    overlap=0.8,
    memory_per_rank=80e9,
    optimizer_foreach=True,
)
A100 = replace(
    H100,  # the same node shape, host overhead and overlap; slower chips and links
    name="A100 SXM node (NVLink 3, 200 Gb/s InfiniBand per GPU)",
    flops={"half": 312e12, "float": 19.5e12},
    memory_bandwidth=2.0e12,
    intra=Link(2e-6, 2.4e11),
    inter=Link(5e-6, 2.25e10),
)
# CPU ranks on one host talking gloo over loopback, as on the development machines: a rough default; calibrate
# for numbers that fit the machine at hand.
CPU_GLOO = CostModel(
    name="CPU ranks on one host (gloo over loopback)",
    flops={"half": 5e9, "float": 2e10},
    memory_bandwidth=5e9,
    efficiency=1.0,
    op_overhead_s=1e-4,
    intra=Link(2.5e-5, 1e9),
    inter=Link(2.5e-5, 1e9),
    ranks_per_node=1 << 30,
    overlap=0.0,
)
