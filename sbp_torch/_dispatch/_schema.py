"""What an aten op's schema says that dispatch needs, read once per op (``op_schema``): reading ``func._schema``
(arguments, alias annotations, tags) on every call would cost more than the rest of a cached call. The memo grows with
the number of distinct ops a program calls, not with shapes, so it needs no bound."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._signatures import rule_for

aten = torch.ops.aten

# Ops that write arguments their schema does not mark as written, as op -> (flag argument that must be
# true, written arguments): batch norm updates its running statistics in training.
UNMARKED_WRITES = {
    aten.native_batch_norm.default: ("training", ("running_mean", "running_var")),
}


@dataclass(frozen=True)
class OpSchema:
    func: object
    names: tuple[str, ...]  # argument names in schema order
    defaults: tuple  # (name, default) of every argument that has a default
    # Positions and names of the Scalar-typed ("number") arguments that the op's rule does not read: keyed by type.
    scalar_positions: frozenset
    scalar_names: frozenset
    list_positions: tuple[int, ...]  # positions of list-typed arguments (a foreach op's lists)
    written: frozenset  # names of arguments the op writes into (self of in-place ops, out=)
    outs: frozenset  # names of out= arguments (written, and not read)
    returns_written: bool  # the op returns the tensors it writes, not new ones
    written_returns: tuple  # (return index, argument name) of each result that is a written argument (add_'s self)
    returns_tensors: bool  # returns new tensors (not nothing, not the written arguments)
    returns: int  # how many values the schema returns
    returns_one_tensor: bool  # returns exactly one Tensor (not a list of them)
    # a pointwise op with one tensor result and no out=, which running does not advance the generator: its output's
    # shape and dtype come from ``_outputs.pointwise_outputs``
    simple_pointwise: bool
    inplace_view: bool  # squeeze_, transpose_, ...: changes self's own shape
    foreach: bool  # _foreach_*: runs index by index
    unmarked: tuple | None  # UNMARKED_WRITES entry

    @staticmethod
    def read(func) -> OpSchema:
        arguments = func._schema.arguments
        written = [a for a in arguments if a.alias_info is not None and a.alias_info.is_write]
        returns = func._schema.returns
        rule = rule_for(func)
        read = rule.reads if rule is not None else frozenset()
        scalar = [
            (i, a.name)
            for i, a in enumerate(arguments)
            if str(a.type) in ("number", "List[number]") and a.name not in read
        ]
        one_tensor = len(returns) == 1 and str(returns[0].type) == "Tensor"
        outs = frozenset(a.name for a in written if a.is_out)
        written_by_alias = {frozenset(a.alias_info.before_set): a.name for a in written}
        written_returns = tuple(
            (j, written_by_alias[frozenset(r.alias_info.before_set)])
            for j, r in enumerate(returns)
            if r.alias_info is not None
            and r.alias_info.is_write
            and frozenset(r.alias_info.before_set) in written_by_alias
        )
        return OpSchema(
            func=func,
            names=tuple(a.name for a in arguments),
            defaults=tuple((a.name, a.default_value) for a in arguments if a.has_default_value()),
            scalar_positions=frozenset(i for i, _ in scalar),
            scalar_names=frozenset(n for _, n in scalar),
            list_positions=tuple(i for i, a in enumerate(arguments) if str(a.type).startswith("List[")),
            written=frozenset(a.name for a in written),
            outs=outs,
            returns_written=bool(returns) and all(r.alias_info is not None and r.alias_info.is_write for r in returns),
            written_returns=written_returns,
            returns_tensors=bool(returns) and not any(r.alias_info is not None for r in returns),
            returns=len(returns),
            returns_one_tensor=one_tensor,
            simple_pointwise=(
                torch.Tag.pointwise in func.tags
                and torch.Tag.nondeterministic_seeded not in func.tags  # running it would advance the generator
                and one_tensor
                and not outs
            ),
            inplace_view=torch.Tag.inplace_view in func.tags,
            foreach=func._schema.name.startswith("aten::_foreach_"),
            unmarked=UNMARKED_WRITES.get(func),
        )

    def name_of(self, where) -> str:
        """The schema name of argument ``where`` (a position or a keyword)."""
        return where if isinstance(where, str) else self.names[where]


# id(op) -> OpSchema: an op's hash is computed in Python, its id is not; the entry keeps the op, and an
# entry whose op is not the one asked for (a freed op's id reused) is read again.
_SCHEMAS: dict = {}


def op_schema(func) -> OpSchema:
    schema = _SCHEMAS.get(id(func))
    if schema is None or schema.func is not func:
        schema = _SCHEMAS[id(func)] = OpSchema.read(func)
    return schema
