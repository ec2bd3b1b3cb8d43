"""The cost model: what a collective, an op and a step cost on some machine, as data with named constants.

Communication is priced per collective as ``latency + factor * bytes / bandwidth`` on the link its group
spans (within a node or across nodes), where ``factor`` is what a ring algorithm moves per byte a rank puts
in (``COLLECTIVE_FACTORS``). Compute is priced per op by the roofline: the larger of its FLOPs against the
peak of its dtype and its bytes against memory bandwidth, both at ``efficiency``, plus the host's time per op
(``op_overhead_s``: the Python of an eager global op). Parameter collectives (gradient reductions, sharded
gathers) run beside compute: ``overlap`` is the fraction of their time compute hides."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

import torch


@dataclass(frozen=True)
class Link:
    """One kind of connection between ranks: seconds per collective call and bytes per second."""

    latency_s: float
    bandwidth: float


# Collective kind prefix (as ``sbp_torch.explain`` names it) -> (bytes moved per byte a rank puts in, as a
# function of the group size n); a ring all-reduce moves each byte twice, an all-gather sends its part n-1 times.
COLLECTIVE_FACTORS = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-gather": lambda n: n - 1,
    "all-to-all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "point-to-point": lambda n: 1.0,  # the bytes a rank sends to the ranks that need them
}


def _factor(kind: str, n: int) -> float:
    for prefix, factor in COLLECTIVE_FACTORS.items():
        if kind.startswith(prefix):
            return factor(n)
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
    """

    name: str
    flops: dict = field(default_factory=dict)
    memory_bandwidth: float = 1e11
    efficiency: float = 0.6
    op_overhead_s: float = 0.0
    intra: Link = Link(1e-5, 1e11)
    inter: Link = Link(2e-5, 1e10)
    ranks_per_node: int = 8
    overlap: float = 0.0
    memory_per_rank: float = float("inf")

    def link(self, ranks) -> Link:
        """The link a group of ``ranks`` communicates over."""
        return self.intra if len({r // self.ranks_per_node for r in ranks}) == 1 else self.inter

    def collective_s(self, kind: str, ranks, nbytes: int) -> float:
        """Seconds one collective ``kind`` takes in the group ``ranks`` when each rank puts in ``nbytes``."""
        n = len(ranks)
        if n <= 1:
            return 0.0
        link = self.link(ranks)
        return link.latency_s + _factor(kind, n) * nbytes / link.bandwidth

    def op_s(self, flops: float, nbytes: float, dtype: torch.dtype) -> float:
        """Seconds of one op on one rank: the roofline of its FLOPs and bytes, plus the host's overhead."""
        peak = self.flops.get("half" if dtype in _HALF else "float", 1e12)
        return self.op_overhead_s + max(flops / peak, nbytes / self.memory_bandwidth) / self.efficiency

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
    intra=Link(1e-5, 3.6e11),
    inter=Link(2e-5, 4.5e10),
    ranks_per_node=8,
    overlap=0.8,
    memory_per_rank=80e9,
)
A100 = CostModel(
    name="A100 SXM node (NVLink 3, 200 Gb/s InfiniBand per GPU)",
    flops={"half": 312e12, "float": 19.5e12},
    memory_bandwidth=2.0e12,
    efficiency=0.6,
    op_overhead_s=3e-5,
    intra=Link(1e-5, 2.4e11),
    inter=Link(2e-5, 2.25e10),
    ranks_per_node=8,
    overlap=0.8,
    memory_per_rank=80e9,
)
# CPU ranks on one host talking gloo over loopback, as on the development machines: a rough default; calibrate
# for numbers that fit the machine at hand.
CPU_GLOO = CostModel(
    name="CPU ranks on one host (gloo over loopback)",
    flops={"half": 5e9, "float": 2e10},
    memory_bandwidth=5e9,
    efficiency=1.0,
    op_overhead_s=1e-4,
    intra=Link(1.5e-4, 1e9),
    inter=Link(1.5e-4, 1e9),
    ranks_per_node=1 << 30,
    overlap=0.0,
)
