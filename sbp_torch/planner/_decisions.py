"""What a plan decides about a model: its units (the repeated blocks, which share one decision), and for each
module with a choice the layouts it may take on the tensor-parallel axis (``OPTIONS``, as data).

A decision covers modules that take the same input tensor (q, k and v; gate and up), since splitting some
of them and not others only adds collectives. Tied parameters are decided once, by the first module that
holds them. Every option here is an ordinary SBP per parameter: the dispatcher's signature table then
decides each op, so whatever the search picks runs."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from torch import nn

from .._api._sharding import default_units
from .._layout import SbpType, Split, broadcast


def _linear_out_dim(module: nn.Module) -> int | None:
    """The output-features dim of a linear layer's 2-D weight (``nn.Linear``: 0; transformers' ``Conv1D``: 1),
    or None for a module that is not one."""
    weight, bias = module._parameters.get("weight"), module._parameters.get("bias")
    if weight is None or weight.dim() != 2 or isinstance(module, nn.Embedding):
        return None
    if isinstance(module, nn.Linear):
        return 0
    if bias is not None and bias.dim() == 1 and weight.shape[0] != weight.shape[1]:
        return weight.shape.index(bias.shape[0]) if bias.shape[0] in weight.shape else None
    return 1 if type(module).__name__ == "Conv1D" else None


def options_of(module: nn.Module) -> dict[str, dict[str, SbpType]] | None:
    """Option name -> {parameter name in ``module``: its SBP on the tensor-parallel axis}, or None where the
    module has no choice (its parameters stay broadcast there)."""
    if isinstance(module, nn.Embedding):
        return {"replicate": {"weight": broadcast}, "vocab": {"weight": Split(0)}, "features": {"weight": Split(1)}}
    out = _linear_out_dim(module)
    if out is None:
        return None
    return {
        "replicate": {"weight": broadcast, "bias": broadcast},
        "column": {"weight": Split(out), "bias": Split(0)},  # output features split: a split result
        "row": {"weight": Split(1 - out), "bias": broadcast},  # input features split: a partial result
    }


@dataclass
class Decision:
    """One choice: ``modules`` (names relative to the group's unit, or to the model for the root) all take the
    same option of ``options``."""

    modules: list[str]
    options: dict[str, dict[str, SbpType]]

    @property
    def label(self) -> str:
        return "+".join(self.modules)


@dataclass
class Group:
    """The root (``container`` is None) or one container of repeated units, with its decisions."""

    container: str | None
    units: list[str]  # full names of the units (empty for the root)
    decisions: list[Decision] = field(default_factory=list)

    def combinations(self) -> list[tuple[str, ...]]:
        """Every assignment of an option to each decision, in a fixed order."""
        return list(itertools.product(*(list(d.options) for d in self.decisions)))

    def pattern(self) -> str:
        """The glob naming its units (``"model.layers.*"``), or ``""`` for the root."""
        return f"{self.container}.*" if self.container else ""


def unit_containers(model: nn.Module) -> dict[str, list[str]]:
    """Container name -> the names of its units, in order (``default_units`` without the root)."""
    found: dict[str, list[str]] = {}
    for name in default_units(model)[1:]:
        found.setdefault(name.rpartition(".")[0], []).append(name)
    return found


def in_unit(name: str, units: list[str]) -> bool:
    return any(name == u or name.startswith(u + ".") for u in units)


def groups_of(model: nn.Module, inputs: dict[str, int]) -> list[Group]:
    """The root group and one group per unit container. ``inputs`` maps a module's full name to an id of the
    tensor it was called on (from a traced forward): modules called on one tensor share one decision. A
    container's decisions come from its first unit, then its second for what the first lacks; all its units
    follow them (by names relative to the unit)."""
    containers = unit_containers(model)
    all_units = [u for units in containers.values() for u in units]
    groups = [Group(None, [])] + [Group(c, units) for c, units in containers.items()]
    modules = list(model.named_modules())
    owned: set[int] = set()  # parameters already decided (tied ones go with their first holder)
    for group in groups:
        scopes = [None] if group.container is None else group.units[:2]
        decided: set[str] = set()
        for scope in scopes:
            by_input: dict[tuple, Decision] = {}
            for name, module in modules:
                inside = not in_unit(name, all_units) if scope is None else name.startswith(scope + ".")
                if not inside:
                    continue
                options = options_of(module)
                params = [id(p) for p in module._parameters.values() if p is not None]
                relative = name if scope is None else name[len(scope) + 1 :]
                if options is None or relative in decided or not params or all(p in owned for p in params):
                    continue
                owned.update(params)
                decided.add(relative)
                key = (tuple(options), inputs.get(name, name))
                by_input.setdefault(key, Decision([], options)).modules.append(relative)
            group.decisions += list(by_input.values())
    return groups


def parameter_layouts(model: nn.Module, groups: list[Group], choice: dict) -> dict[str, SbpType]:
    """Full parameter name -> its SBP on the tensor axis, for ``choice``: group index -> option per decision.
    Parameters no decision covers are broadcast."""
    layouts: dict[str, SbpType] = {}
    first_name: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(p), name)
    modules = dict(model.named_modules())
    for index, group in enumerate(groups):
        picked = choice.get(index)
        if picked is None:
            continue
        for decision, option in zip(group.decisions, picked):
            sbps = decision.options[option]
            for relative in decision.modules:
                names = [relative] if group.container is None else [f"{u}.{relative}" for u in group.units]
                for module_name in names:
                    module = modules.get(module_name)
                    if module is None:
                        continue
                    for pname, p in module._parameters.items():
                        if p is not None and pname in sbps:
                            layouts[first_name[id(p)]] = sbps[pname]
    return layouts
