"""What an aten op's schema says that dispatch needs, read once per op and cached.

Dispatch runs on every op; reading ``func._schema`` each time (argument lists, alias annotations, tags) would
cost more than the rest of a cached call. ``facts(func)`` gives it all at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._signatures.foreach import is_foreach

aten = torch.ops.aten

# Ops that write arguments their schema does not mark as written, as op -> (flag argument that must be
# true, written arguments): batch norm updates its running statistics in training.
UNMARKED_WRITES = {
    aten.native_batch_norm.default: ("training", ("running_mean", "running_var")),
}


@dataclass(frozen=True)
class OpFacts:
    names: tuple[str, ...]  # argument names in schema order
    scalar_positions: frozenset  # positions / names of arguments typed Scalar ("number")
    scalar_names: frozenset
    written: frozenset  # names of arguments the op writes into (self of in-place ops, out=)
    outs: frozenset  # names of out= arguments (written, and not read)
    returns_written: bool  # the op returns the tensors it writes, not new ones
    inplace_view: bool  # squeeze_, transpose_, ...: changes self's own shape
    foreach: bool  # _foreach_*: runs index by index
    returns_tensors: bool  # returns new tensors (not nothing, not the written arguments)
    unmarked: tuple | None  # UNMARKED_WRITES entry


_facts: dict = {}


def facts(func) -> OpFacts:
    cached = _facts.get(func)
    if cached is not None:
        return cached
    arguments = func._schema.arguments
    written = [a for a in arguments if a.alias_info is not None and a.alias_info.is_write]
    returns = func._schema.returns
    scalar = [(i, a.name) for i, a in enumerate(arguments) if str(a.type) in ("number", "List[number]")]
    result = OpFacts(
        names=tuple(a.name for a in arguments),
        scalar_positions=frozenset(i for i, _ in scalar),
        scalar_names=frozenset(n for _, n in scalar),
        written=frozenset(a.name for a in written),
        outs=frozenset(a.name for a in written if a.is_out),
        returns_written=bool(returns) and all(r.alias_info is not None and r.alias_info.is_write for r in returns),
        inplace_view=torch.Tag.inplace_view in func.tags,
        foreach=is_foreach(func),
        returns_tensors=bool(returns) and not any(r.alias_info is not None for r in returns),
        unmarked=UNMARKED_WRITES.get(func),
    )
    _facts[func] = result
    return result


def argument_name(func, slot) -> str:
    """The schema name of argument ``slot`` (a position or a keyword)."""
    return slot if isinstance(slot, str) else facts(func).names[slot]
