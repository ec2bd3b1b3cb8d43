"""What a signature rule is, what it sees, and the registry that maps aten ops to rules.

A *rule* looks at one op call (logical shapes, dtypes and static arguments; never data, never this rank)
and returns the op's valid 1-D signatures as data: for each global tensor input (in flattened argument
order) the SBP it must have, and for each tensor output the SBP it then has. Running the op on the local
parts of inputs in those SBPs must give the local parts of the outputs in theirs. N-D signatures are the
product of the 1-D ones over the placement axes, filtered by the rule's optional ``check_nd``.

Most signatures run the aten op itself on the local parts. A signature may instead name a *local
function* of its rule, which computes the local outputs differently (cross entropy over a vocabulary split
across ranks needs a max and a sum over the split axes). A local function gets a ``LocalContext``: this
rank's coordinate and regions, the call's local arguments by name, and the few collectives it may need.

This module is the table's core: family files import only from here (and torch). Nothing here
communicates; the context's collectives are given to it by the dispatcher.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .._layout import (
    GlobalMeta,
    SbpType,
    Split,
    broadcast,
    partial_max,
    partial_min,
    partial_sum,
    partials_as_broadcast,
    random_region,
)
from .._layout import Partial as Partial  # re-exported for the family files
from .._layout import contiguous_strides as contiguous_strides  # re-exported for the family files

B, P, P_MAX, P_MIN, S = broadcast, partial_sum, partial_max, partial_min, Split
PARTIALS = (P, P_MAX, P_MIN)


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
    """One valid 1-D layout of an op: an SBP per global input, an SBP per tensor output. ``local_fn`` names a
    function in the rule's ``local_fns`` that computes the local outputs instead of the op."""

    inputs: tuple[SbpType, ...]
    outputs: tuple[SbpType, ...]
    local_fn: str | None = None

    def __repr__(self) -> str:
        ins = ", ".join(map(repr, self.inputs))
        outs = ", ".join(map(repr, self.outputs))
        return f"({ins}) -> ({outs})" + (f" [{self.local_fn}]" if self.local_fn else "")


@dataclass
class OpCall:
    """An op call as a rule sees it. ``inputs`` are the global tensor inputs in flattened argument order (the
    order of ``Signature.inputs``); ``outputs`` the tensor outputs (order of ``Signature.outputs``); ``bound`` maps
    schema argument names to values (defaults filled in), with ``TensorInfo`` in place of global tensors."""

    func: object
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    bound: dict
    mesh_shape: tuple[int, ...]

    def arg(self, name: str, default=None):
        value = self.bound.get(name, default)
        return default if value is None else value


@dataclass
class LocalContext:
    """What a local function knows (see the module docstring). ``inputs`` holds the GlobalMeta of each global
    input in its chosen layout and ``outputs`` of each tensor output; ``axes`` are the placement axes whose
    signature names the local function (the others carry plain signatures that commute with it); ``arguments``
    the call's arguments by schema name, defaults filled in, with local parts in place of global tensors.
    ``coord`` is None on a rank outside the placement."""

    placement: object
    coord: tuple[int, ...] | None
    inputs: tuple[GlobalMeta, ...]
    outputs: tuple[GlobalMeta, ...]
    axes: tuple[int, ...]
    arguments: dict
    reduce_along: Callable = field(repr=False)  # (tensor, op, axis) -> the tensor all-reduced along the axis
    box: Callable = field(repr=False)  # (local part, GlobalMeta, sbp) -> this rank's part in that sbp

    def region(self, meta: GlobalMeta) -> tuple[list[int], list[int]]:
        """(starts, lengths) of this rank's region of a tensor laid out as ``meta``."""
        return meta.region(self.coord)

    def local_output_shape(self, index: int = 0) -> tuple[int, ...]:
        """The shape of this rank's part of output ``index``."""
        return self.outputs[index].local_shape(self.coord)

    def all_reduce(self, x: torch.Tensor, op: str = "sum", axes=None) -> torch.Tensor:
        """``x`` all-reduced with ``op`` along each of ``axes`` (default: the local function's axes), the step a
        local function takes to combine what its ranks computed from their parts."""
        for axis in self.axes if axes is None else axes:
            x = self.reduce_along(x, op, axis)
        return x

    def draw(self, kind: str, meta: GlobalMeta, device) -> torch.Tensor | None:
        """This rank's region of fresh random values (``"uniform"`` or ``"normal"``) of ``meta``'s shape and
        dtype, partial axes held whole; None outside the placement. The values do not depend on the layout
        (``_layout/_random.py``); every rank must draw, as it advances the generator."""
        starts, lengths = (
            (None, None) if self.coord is None else meta.with_sbp(partials_as_broadcast(meta.sbp)).region(self.coord)
        )
        return random_region(kind, meta.shape, meta.dtype, starts, lengths, device)

    def call(self, func, **overrides):
        """``func`` called with this call's arguments, the named ones replaced by ``overrides``."""
        args, kwargs = [], {}
        for a in func._schema.arguments:
            if a.name not in self.arguments and a.name not in overrides:
                continue
            value = overrides.get(a.name, self.arguments.get(a.name))
            if a.kwarg_only:
                kwargs[a.name] = value
            else:
                args.append(value)
        return func(*args, **kwargs)


@dataclass(frozen=True)
class Rule:
    """How to find the signatures of an op (or a family of ops)."""

    signatures: Callable[[OpCall], list[Signature]]
    check_nd: Callable[[OpCall, tuple[Signature, ...]], bool] | None = None
    local_fns: dict = field(default_factory=dict)  # name -> fn(func, LocalContext) -> the local outputs
    # Run on ranks outside the placement instead of the op, as fn(func, LocalContext): for effects every rank
    # must share, like advancing the random generator.
    outside: Callable | None = None


RULES: dict = {}
_FAMILY_RULES: list[tuple[Callable, Rule]] = []


def register(*ops, check_nd=None, local_fns=None, outside=None):
    """Decorator: the decorated function gives the 1-D signatures of ``ops`` (aten overloads or packets)."""

    def add(fn):
        rule = Rule(fn, check_nd, local_fns or {}, outside)
        for op in ops:
            packet = isinstance(op, torch._ops.OpOverloadPacket)
            for overload in [getattr(op, name) for name in op.overloads()] if packet else [op]:
                RULES[overload] = rule
        return fn

    return add


def register_family(matches: Callable, check_nd=None, local_fns=None):
    """Decorator for a rule that covers every op for which ``matches(op)`` is true (tried in order, after
    the ops registered by name)."""

    def add(fn):
        _FAMILY_RULES.append((matches, Rule(fn, check_nd, local_fns or {})))
        return fn

    return add


def rule_for(func) -> Rule | None:
    """The rule of ``func``: registered by name, else the first family that matches, else None."""
    rule = RULES.get(func)
    if rule is not None:
        return rule
    for matches, family_rule in _FAMILY_RULES:
        if matches(func):
            RULES[func] = family_rule
            return family_rule
    return None


# What several families share


def operand_sbp(out_shape: tuple[int, ...], operand: TensorInfo, dim: int):
    """The SBP an operand broadcast to ``out_shape`` needs so that the output can be split on ``dim``."""
    operand_dim = dim - (len(out_shape) - operand.ndim)
    if operand_dim < 0 or operand.shape[operand_dim] != out_shape[dim]:
        return B
    return S(operand_dim)


def pass_through(n_in: int, n_out: int, local_fn: str | None = None) -> list[Signature]:
    """``B -> B`` and each partial to itself, for every input and output."""
    return [Signature((s,) * n_in, (s,) * n_out, local_fn) for s in (B, *PARTIALS)]


def like_input(call: OpCall, local_fn: str | None = None) -> list[Signature]:
    """Outputs shaped like the input, whose values are not read: S(d) -> S(d) for each dim, B and partials -> B."""
    n_out = len(call.outputs)
    splits = [Signature((S(d),), (S(d),) * n_out, local_fn) for d in range(call.inputs[0].ndim)]
    return splits + [Signature((s,), (B,) * n_out, local_fn) for s in (B, *PARTIALS)]


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
    """A ``check_nd`` for ops whose local computations fail on empty parts (convolution, batch norm): every
    split must leave each rank at least one element of the split dim, or one rank would fail alone and leave
    the others waiting in the next collective."""
    return all(
        smallest_part(call, combo, i, sbp.dim) > 0
        for sig in combo
        for i, sbp in enumerate(sig.inputs)
        if isinstance(sbp, Split)
    )
