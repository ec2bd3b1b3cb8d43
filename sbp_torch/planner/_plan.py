"""``Plan``: a layout for a model as data: the mesh, each parameter's SBP and storage, the batch's and the
hidden state's layout at unit edges, and what the planner predicted. It prints as a table, saves and loads
as JSON, and ``model.to_global(plan)`` applies it."""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.distributed._composable import checkpoint as recomputed_in_backward

from .._api import module_to_global
from .._layout import GlobalMeta, Partial, Placement, SbpType, Split, broadcast
from .._tensor import GlobalTensor
from ._cost_model import CostModel
from ._estimate import Estimate
from ._meshes import Mesh
from ._pins import BoundaryPin


def sbp_text(sbp: tuple[SbpType, ...]) -> str:
    return ", ".join(map(repr, sbp))


def sbp_from_text(text: str) -> tuple[SbpType, ...]:
    """The inverse of ``sbp_text``: ``"B, S(0)"`` -> ``(broadcast, split(0))``."""
    parts = []
    for item in (t.strip() for t in text.split(",")):
        if item == "B":
            parts.append(broadcast)
        elif item.startswith("S(") and item.endswith(")"):
            parts.append(Split(int(item[2:-1])))
        elif item == "P" or (item.startswith("P(") and item.endswith(")")):
            parts.append(Partial(item[2:-1] if item != "P" else "sum"))
        else:
            raise ValueError(f"not an SBP: {item!r} in {text!r}")
    return tuple(parts)


@dataclass
class Prediction:
    """What the planner expects one training step of a plan to cost on one rank."""

    step_s: float
    compute_s: float
    comm_s: float  # activation collectives
    param_comm_s: float  # gradient reductions and sharded gathers, before overlap with compute
    optimizer_s: float
    memory: dict  # term -> bytes per rank
    collectives: dict  # kind -> count per step

    @property
    def memory_bytes(self) -> float:
        return float(sum(self.memory.values()))

    @classmethod
    def of(cls, est: Estimate, costs: CostModel) -> Prediction:
        return cls(
            est.step_s(costs),
            est.compute_s,
            est.comm_s,
            est.param_comm_s,
            est.optimizer_s,
            {k: float(v) for k, v in est.memory.items()},
            {k: float(v) for k, v in est.collectives.items() if v},
        )


@dataclass
class Plan:
    """A layout for one model on ``world_size`` ranks (docs/planning.md).

    Attributes:
        mesh: the placement's shape; ``data_axis`` splits the batch, ``tensor_axis`` the layers (either may be
            None). ``sharded``: parameters are stored split over the data axis (``Module.to_global(shard=)``).
        parameters: full parameter name -> its SBP (text, one entry per placement axis) while computing.
        boundaries: unit name pattern -> the hidden state's SBP at the unit's input and output (each ``*`` of a
            pattern matches one name: ``"model.layers.*"`` names the layers, not the modules inside them).
        decisions: per group (the root ``""``, or a unit pattern) the option each set of modules took.
        predicted: the planner's estimate; ``alternatives``: the best estimate of every mesh and storage tried
            (``replicated``: nothing split over its tensor axis, never chosen while another fits; ``measured_s``:
            its timed step, where ``plan(measure=k)`` timed it).
        measured_s: the median seconds of a real step, where ``plan(measure=k)`` timed it (None otherwise).
        step: the step priced: ``"eager"`` (op by op through the dispatcher) or ``"compiled"`` (``compile_step``).
        recompute: unit patterns whose units keep only their inputs for backward and run their forward again
            there (activation checkpointing: ``torch.distributed._composable.checkpoint`` on each unit).
    """

    world_size: int
    mesh: tuple[int, ...]
    data_axis: int | None
    tensor_axis: int | None
    sharded: bool
    parameters: dict[str, str]
    boundaries: dict[str, str]
    predicted: Prediction
    decisions: dict = field(default_factory=dict)  # group ("" root, or unit pattern) -> {modules: option}
    cost_model: str = ""
    device: str = "cpu"
    search: dict = field(default_factory=dict)
    alternatives: list = field(default_factory=list)
    measured_s: float | None = None
    step: str = "eager"
    recompute: list = field(default_factory=list)  # unit patterns whose units are recomputed in backward

    @property
    def mesh_label(self) -> str:
        """The mesh and storage, as ``alternatives`` name them (``"sharded data 2 x tensor 2"``)."""
        return describe_mesh(self.mesh, self.data_axis, self.tensor_axis, self.sharded)

    @property
    def label(self) -> str:
        label = self.mesh_label
        if self.tensor_axis is not None and all(
            not isinstance(sbp_from_text(text)[self.tensor_axis], Split) for text in self.parameters.values()
        ):
            label += " (nothing split over it: each of its ranks runs the whole step)"
        return label

    def placement(self) -> Placement:
        """The placement the plan lays tensors out on: ranks 0 to world_size - 1 in the mesh's shape."""
        return Mesh(self.mesh, self.data_axis, self.tensor_axis).placement(self.device)

    def apply_to(self, module: nn.Module) -> nn.Module:
        """Lay ``module`` out by this plan, in place (what ``module.to_global(plan)`` does)."""
        placement = self.placement()
        sbp = {name: sbp_from_text(text) for name, text in self.parameters.items()}
        shard = self.data_axis if self.sharded else None
        module_to_global(module, placement, sbp, shard=shard)
        for name, sub in module.named_modules():
            for pattern, text in self.boundaries.items():
                if names_unit(pattern, name):
                    BoundaryPin.install(sub, sbp_from_text(text))
            # (after the layout's hooks and the pin: a recomputation calls the unit again through them, gathering
            # its sharded parameters and pinning its input as the first call did)
            if any(names_unit(pattern, name) for pattern in self.recompute):
                recomputed_in_backward(sub)
        return module

    def batch_sbp(self, tensor: torch.Tensor) -> tuple[SbpType, ...]:
        """The layout of one batch tensor: rows split over the data axis."""
        return Mesh(self.mesh, self.data_axis, self.tensor_axis).rows_split(tensor.dim())

    def layout(self, batch):
        """The whole logical ``batch`` (a tensor, or a tuple or dict of them, the same on every rank) laid out by
        the plan; each rank keeps its part, with no communication."""
        placement = self.placement()
        coord = placement.local_coord()

        def one(x):
            if not isinstance(x, torch.Tensor):
                return x
            meta = GlobalMeta(tuple(x.shape), x.dtype, placement, self.batch_sbp(x))
            starts, lengths = meta.region(coord)
            local = x
            for dim, (start, length) in enumerate(zip(starts, lengths)):
                local = local.narrow(dim, start, length)
            return GlobalTensor(local.contiguous().to(placement.device()), meta)

        if isinstance(batch, dict):
            return {k: one(v) for k, v in batch.items()}
        if isinstance(batch, (tuple, list)):
            return type(batch)(one(v) for v in batch)
        return one(batch)

    def __str__(self) -> str:
        p = self.predicted
        lines = [
            f"plan for {self.world_size} ranks: {self.label} (mesh {list(self.mesh)}), cost model: {self.cost_model}, "
            f"{self.step} step",
            f"  predicted step {p.step_s * 1e3:.3f} ms: compute {p.compute_s * 1e3:.3f}, collectives "
            f"{p.comm_s * 1e3:.3f}, parameter traffic {p.param_comm_s * 1e3:.3f} (before overlap), optimizer "
            f"{p.optimizer_s * 1e3:.3f}",
            f"  memory per rank {_mib(p.memory_bytes)}: "
            + ", ".join(f"{k} {_mib(v)}" for k, v in p.memory.items() if v),
            "  collectives per step: " + ", ".join(f"{k} {round(v)}" for k, v in sorted(p.collectives.items()) if v),
            "",
        ]
        if self.measured_s is not None:
            lines.insert(2, f"  measured step {self.measured_s * 1e3:.3f} ms (median of timed steps, eager)")
        for group, chosen in self.decisions.items():
            lines += [
                f"  {group or '(root)'}: " + ", ".join(f"{modules} {option}" for modules, option in chosen.items())
            ]
        split = {name: text for name, text in self.parameters.items() if set(text.split(", ")) != {"B"}}
        lines += ["", f"  {'parameter':48} layout (every other parameter: broadcast)"]
        lines += [f"  {name:48} {text}" for name, text in split.items()]
        lines += [f"  boundary {pattern}: {text}" for pattern, text in self.boundaries.items()]
        lines += [f"  recomputed in backward: {pattern}" for pattern in self.recompute]
        if self.alternatives:
            timed = any(a.get("measured_s") is not None for a in self.alternatives)
            lines += ["", f"  {'layout tried':32} {'step ms':>10} {'memory':>12}" + (f" {'measured ms':>12}" * timed)]
            lines += [_alternative_line(a, timed, a["label"] == self.mesh_label) for a in self.alternatives]
        if self.search:
            lines += ["", "  search: " + ", ".join(f"{k} {v}" for k, v in self.search.items())]
        return "\n".join(lines)

    def to_json(self) -> str:
        data = asdict(self)
        data["mesh"] = list(self.mesh)
        return json.dumps(data, indent=1, default=_finite)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        data["mesh"] = tuple(data["mesh"])
        data["predicted"] = Prediction(**data["predicted"])
        return cls(**data)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> Plan:
        with open(path) as f:
            return cls.from_json(f.read())


def names_unit(pattern: str, name: str) -> bool:
    """Whether the unit pattern ``pattern`` (``"model.layers.*"``) names the module ``name``: name by name, each
    ``*`` one name, so that the modules inside a unit (``model.layers.0.mlp``) are not taken for units."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatch.fnmatchcase(n, p) for n, p in zip(names, parts))


def describe_mesh(mesh, data_axis, tensor_axis, sharded) -> str:
    parts = []
    if data_axis is not None:
        parts.append(f"{'sharded ' if sharded else ''}data {mesh[data_axis]}")
    if tensor_axis is not None:
        parts.append(f"tensor {mesh[tensor_axis]}")
    return " x ".join(parts)


def _alternative_line(alternative: dict, timed: bool, chosen: bool) -> str:
    line = f"  {alternative['label']:32} {alternative['step_s'] * 1e3:>10.3f} {_mib(alternative['memory_bytes']):>12}"
    if timed:
        measured = alternative.get("measured_s")
        line += f" {'-' if measured is None else f'{measured * 1e3:.3f}':>12}"
    if alternative.get("recomputed"):
        line += "  (units recomputed)"
    return line + ("  (nothing split over tensor: not chosen)" if alternative.get("replicated") and not chosen else "")


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if math.isfinite(nbytes) else "inf"


def _finite(value):
    return str(value)
