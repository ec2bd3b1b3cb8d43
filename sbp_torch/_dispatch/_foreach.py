"""Foreach ops (``_foreach_*``, optimizers' multi-tensor kernels) on lists of global tensors. Indices may differ in
layout, so a key's first call runs index by index, each a call of its own (decided and cached like any op); if every
index ran on its parts as they were, the key becomes a ``ForeachPlan``, one local foreach call, as torch's optimizers
expect for speed; else ``PerIndex``. ``COALESCED`` ops (norms, which reduce across ranks) have their own path.

Torch bumps a global tensor's version in its autograd layer for in-place ops, but not for foreach ones (a plain tensor's
is bumped in its kernel); so each global tensor in a written list is bumped here, or autograd would not see a saved
tensor changed by an optimizer step."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import _comm as comm
from .._tensor import GlobalTensor
from ._bound import BoundCall
from ._call_plan import checked_global
from ._foreach_norm import COALESCED
from ._schema import OpSchema


def split_foreach_call(schema: OpSchema, args, kwargs) -> list[tuple[tuple, dict]]:
    """The single-index calls (args, kwargs) a foreach call is made of; lists become one-element lists."""
    lists = set(schema.list_positions)
    list_names = {schema.names[i] for i in lists}
    n = next((len(args[i]) for i in sorted(lists) if i < len(args)), 0)

    def at(value, is_list: bool, i: int):
        return [value[i]] if is_list and value is not None else value

    return [
        (
            tuple(at(a, p in lists, i) for p, a in enumerate(args)),
            {k: at(v, k in list_names, i) for k, v in kwargs.items()},
        )
        for i in range(n)
    ]


def bump_written_lists(schema: OpSchema, args) -> None:
    """Bump the version of each global tensor in the lists the call wrote into (see the module docstring)."""
    for position, name in enumerate(schema.names[: len(args)]):
        if name in schema.written:
            torch._C._increment_version([t for t in args[position] if isinstance(t, GlobalTensor)])


@dataclass(frozen=True)
class ForeachPlan:
    """A foreach call whose every index runs on its local parts as they are: one local foreach call."""

    func: object
    schema: OpSchema
    lists: tuple  # positions of the arguments that are lists of global tensors
    singles: tuple  # positions of the arguments that are one global tensor
    outputs: tuple  # per index, the GlobalMeta of its output (ops that return new tensors)
    local_shapes: tuple
    as_is = True

    def run(self, func, args, kwargs):
        local_args = list(args)
        for where in self.lists:
            local_args[where] = [t._local for t in args[where]]
        for where in self.singles:
            local_args[where] = args[where]._local
        try:
            out = func(*local_args, **kwargs)
        except Exception as err:
            comm.local_failure(func, err)
            raise
        if self.schema.written:
            bump_written_lists(self.schema, args)
        if not self.outputs:
            return None if not self.schema.returns else out
        return [checked_global(func, t, m, shape) for t, m, shape in zip(out, self.outputs, self.local_shapes)]


@dataclass(frozen=True)
class PerIndex:
    """A foreach call some index of which boxes or computes differently: index by index, every time."""

    func: object
    dispatch_one: Callable  # (BoundCall) -> (result, cache entry) of one non-foreach call
    as_is = False

    def run(self, func, args, kwargs):
        return _per_index(BoundCall(func, args, kwargs), self.dispatch_one)[0]


@dataclass(frozen=True)
class Coalesced:
    """A foreach op with its own path for lists of global tensors (``COALESCED``)."""

    func: object
    as_is = False

    def run(self, func, args, kwargs):
        return COALESCED[func](func, args, kwargs)


def _per_index(bound: BoundCall, dispatch_one) -> tuple:
    """Run the call index by index: (the result, the entry of each index: None where no global tensor)."""
    results, entries = [], []
    for one_args, one_kwargs in split_foreach_call(bound.schema, bound.args, bound.kwargs):
        one = BoundCall(bound.func, one_args, one_kwargs)
        out, entry = dispatch_one(one) if one.tensors else (bound.func(*one_args, **one_kwargs), None)
        results.append(out)
        entries.append(entry)
    if bound.schema.written:
        bump_written_lists(bound.schema, bound.args)
    return (None if not bound.schema.returns else [r[0] for r in results]), entries


def first_foreach_call(bound: BoundCall, dispatch_one) -> tuple:
    """(The result of a foreach call seen for the first time, its cache entry)."""
    func = bound.func
    if func in COALESCED and all(isinstance(t, GlobalTensor) for t in bound.args[0]):
        return COALESCED[func](func, bound.args, bound.kwargs), Coalesced(func)
    result, entries = _per_index(bound, dispatch_one)
    per_index = PerIndex(func, dispatch_one)
    if not all(entry is not None and entry.as_is for entry in entries):
        return result, per_index
    slots = bound.slots
    if any(isinstance(where, str) for where, _ in slots):  # globals passed by keyword: stay per index
        return result, per_index
    lists = tuple(sorted({where for where, index in slots if index is not None}))
    singles = tuple(where for where, index in slots if index is None)
    if not all(all(isinstance(t, GlobalTensor) for t in bound.args[where]) for where in lists):
        return result, per_index
    outputs = tuple(entry.decision.outputs[0] for entry in entries) if bound.schema.returns_tensors else ()
    shapes = tuple(m.local_shape(m.placement.local_coord()) for m in outputs)
    return result, ForeachPlan(func, bound.schema, lists, singles, outputs, shapes)
