"""What a signature rule is, what it sees, and the registry that maps aten ops to rules.

A *rule* looks at one op call (logical shapes, dtypes and static arguments; never data, never this rank)
and returns the op's valid 1-D signatures as data: for each global tensor input (in flattened argument
order) the SBP it must have, and for each tensor output the SBP it then has. Running the op on the local
parts of inputs in those SBPs must give the local parts of the outputs in theirs. N-D signatures are the
product of the 1-D ones over the placement axes (``_select.py``), filtered by the rule's optional
``check_nd``.

Most signatures run the aten op itself on the local parts. A signature may instead name a *kernel*: a
function that computes the local outputs differently (for example, cross entropy over a vocabulary split
across ranks, which needs a max and a sum over the split axes). A kernel gets a ``KernelContext`` that says
which placement axes use its signature.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import _collectives as coll
from .._process_groups import axis_group
from .._sbp import Broadcast, Partial, SbpType, Split

B = Broadcast()
P = Partial("sum")
P_MAX = Partial("max")
P_MIN = Partial("min")
S = Split


@dataclass(frozen=True)
class TensorInfo:
    """What a rule may know about a tensor argument or output: its logical shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class Signature:
    """One valid 1-D layout of an op: an SBP per global input, an SBP per tensor output.

    ``kernel`` names a function in the rule's ``kernels`` that computes the local outputs instead of the op.
    """

    inputs: tuple[SbpType, ...]
    outputs: tuple[SbpType, ...]
    kernel: str | None = None

    def __repr__(self) -> str:
        ins = ", ".join(map(repr, self.inputs))
        outs = ", ".join(map(repr, self.outputs))
        return f"({ins}) -> ({outs})" + (f" [{self.kernel}]" if self.kernel else "")


@dataclass
class OpCall:
    """An op call as a rule sees it.

    ``inputs`` are the global tensor inputs in flattened argument order (the order of ``Signature.inputs``);
    ``outputs`` the tensor outputs (order of ``Signature.outputs``), known from running the op on meta
    tensors; ``bound`` maps schema argument names to values, with ``TensorInfo`` for global tensors.
    """

    func: object
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    bound: dict
    mesh_shape: tuple[int, ...]

    def arg(self, name: str, default=None):
        value = self.bound.get(name, default)
        return default if value is None else value


def smallest_part(call: OpCall, combo: tuple, input_index: int, dim: int) -> int:
    """The extent of ``dim`` in the smallest local part of input ``input_index`` under the N-D signature
    ``combo`` (balanced splits: floor division per splitting axis)."""
    extent = call.inputs[input_index].shape[dim]
    for axis, sig in enumerate(combo):
        s = sig.inputs[input_index]
        if isinstance(s, Split) and s.dim == dim:
            extent //= call.mesh_shape[axis]
    return extent


def every_split_part_nonempty(call: OpCall, combo: tuple) -> bool:
    """A ``check_nd`` for ops whose local kernels fail on empty parts (convolution, batch norm): every split
    must leave each rank at least one element of the split dim, or one rank would fail alone and leave the
    others waiting in the next collective."""
    return all(
        smallest_part(call, combo, i, sbp.dim) > 0
        for sig in combo
        for i, sbp in enumerate(sig.inputs)
        if isinstance(sbp, Split)
    )


@dataclass
class KernelContext:
    """What a kernel knows: the placement, the chosen N-D signature, and which axes carry the kernel's
    signature (the others carry plain signatures that commute with it)."""

    placement: object
    inputs: list  # GlobalMeta of each global input, in its chosen layout
    outputs: list  # GlobalMeta of each tensor output
    kernel_axes: tuple[int, ...]
    bound: dict = field(default_factory=dict)

    def all_reduce(self, x: torch.Tensor, op: str = "sum", axes=None) -> torch.Tensor:
        """``x`` all-reduced with ``op`` along each of ``axes`` (default: the kernel's axes), the step a kernel
        takes to combine what its ranks computed from their parts."""
        for axis in self.kernel_axes if axes is None else axes:
            x = coll.all_reduce(x, op, axis_group(self.placement, axis))
        return x


@dataclass(frozen=True)
class Rule:
    """How to find the signatures of an op (or a family of ops)."""

    signatures: Callable[[OpCall], list[Signature]]
    check_nd: Callable[[OpCall, tuple[Signature, ...]], bool] | None = None
    kernels: dict = field(default_factory=dict)
    # Run on ranks outside the placement instead of the op, as (func, ctx, arguments by name): for effects
    # every rank must share, like advancing the random generator.
    outside: Callable | None = None


RULES: dict = {}
_FAMILY_RULES: list[tuple[Callable, Rule]] = []


def register(*ops, check_nd=None, kernels=None, outside=None):
    """Decorator: the decorated function gives the 1-D signatures of ``ops`` (aten overloads or packets)."""

    def add(fn):
        rule = Rule(fn, check_nd, kernels or {}, outside)
        for op in ops:
            for overload in _overloads(op):
                RULES[overload] = rule
        return fn

    return add


def register_family(matches: Callable, check_nd=None, kernels=None):
    """Decorator for a rule that covers every op for which ``matches(op)`` is true (tried in order, after
    the ops registered by name)."""

    def add(fn):
        _FAMILY_RULES.append((matches, Rule(fn, check_nd, kernels or {})))
        return fn

    return add


def _overloads(op) -> list:
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    return [op]


def bind(func, args, kwargs) -> dict:
    """The call's arguments by schema name, defaults filled in."""
    bound = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args):
            bound[a.name] = args[i]
        elif a.name in kwargs:
            bound[a.name] = kwargs[a.name]
        elif a.has_default_value():
            bound[a.name] = a.default_value
    return bound


def rule_for(func) -> Rule | None:
    rule = RULES.get(func)
    if rule is not None:
        return rule
    for matches, family_rule in _FAMILY_RULES:
        if matches(func):
            RULES[func] = family_rule
            return family_rule
    return None

