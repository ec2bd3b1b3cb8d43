"""What a signature rule is, what it sees, and the registry that maps aten ops to rules.

A *rule* looks at one op call (logical shapes and dtypes of its tensors, and the non-tensor arguments it declares;
never data, never this rank) and returns the op's valid 1-D signatures as data: for each tensor argument, by its schema
name, the SBP it must have, and for each tensor output the SBP it then has. Running the op on the local parts of inputs
in those SBPs must give the local parts of the outputs in theirs. N-D signatures are the product of the 1-D ones over
the placement axes, filtered by the rule's optional ``check_nd``.

**The contract.** A rule declares, by name, the non-tensor arguments its decision reads (``reads``). The call cache keys
a call by exactly what a rule may see: its tensors' metadata, every declared argument by value, and the Scalar-typed
arguments it does not declare by type and ``NumberClass`` only (zero, finite, or inf and nan: so that a changing
learning rate does not miss the cache, while a partial scaled by 2 and one divided by 0 decide apart). The call a rule
is shown (``OpCall``) shows those numbers as their classes and hides every other non-tensor argument it did not
declare: reading one raises ``UndeclaredArgument``, so a decision cannot depend on what the key drops. A rule that
returns None declines the call (the fallback runs it); otherwise the registry adds the all-broadcast signature to its
list (every op computes on whole values), unless the rule lists one itself.

Most signatures run the aten op itself on the local parts. A signature may instead name a *local function* of its
rule, which computes the local outputs differently (cross entropy over a vocabulary split across ranks needs a max and
a sum over the split axes). A local function gets a ``LocalContext``: this rank's coordinate and regions, the call's
local arguments by name, and the few collectives it may need. A rule may also state its outputs' shapes and dtypes
(``outputs``), where that is cheaper than running the op on meta tensors.

This module is the table's core: family files import only from here (and torch). Nothing here communicates; the
context's collectives are given to it by the dispatcher.
"""

import cmath
import enum
import math
from collections.abc import Callable, Iterator
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
from .._layout import dense_strides as dense_strides  # re-exported for the family files

B, P, P_MAX, P_MIN, S = broadcast, partial_sum, partial_max, partial_min, Split
PARTIALS = (P, P_MAX, P_MIN)


@dataclass(frozen=True)
class TensorInfo:
    """What a rule may know about a tensor argument or output: its logical shape and dtype; an output's logical
    strides too, where they are not contiguous (None: contiguous)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    strides: tuple[int, ...] | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)


def normalize_dim(dim: int, ndim: int) -> int:
    """``dim`` counted from the front (a 0-dim tensor takes dims 0 and -1, as torch does); IndexError outside."""
    extent = max(ndim, 1)
    if not -extent <= dim < extent:
        raise IndexError(f"dim {dim} is out of range for a {ndim}-dim tensor")
    return dim % extent


def normalize_dims(dims, ndim: int) -> tuple[int, ...]:
    """The dims that ``dims`` names (an int, a list of ints; None or an empty list: every dim), counted from the front,
    sorted; IndexError for one out of range or named twice."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(ndim))
    listed = [normalize_dim(d, ndim) for d in ([dims] if isinstance(dims, int) else dims)]
    if len(set(listed)) != len(listed):
        raise IndexError(f"dims {dims} name a dim twice")
    return tuple(sorted(listed))


@dataclass(frozen=True)
class Signature:
    """One valid 1-D layout of an op: an SBP per tensor argument, by schema name (a list argument takes one SBP for
    every element, or a tuple of them, one per element), and the output SBPs (one SBP for every tensor output, or a
    tuple, one per output). ``local_fn`` names a function in the rule's ``local_fns`` that computes the local outputs
    instead of the op. Build one with ``sig``."""

    inputs: tuple  # ((argument name, SBP or tuple of SBPs), ...)
    outputs: SbpType | tuple
    local_fn: str | None = None

    def sbp_of(self, name: str, index: int | None = None) -> SbpType | None:
        """The SBP this signature asks of argument ``name`` (element ``index`` of a list), or None if it names none."""
        for named, sbp in self.inputs:
            if named == name:
                return sbp[index] if isinstance(sbp, tuple) and index is not None else sbp
        return None

    def output_sbps(self, n_outputs: int) -> tuple:
        return self.outputs if isinstance(self.outputs, tuple) else (self.outputs,) * n_outputs

    def __repr__(self) -> str:
        ins = ", ".join(f"{name}={sbp!r}" for name, sbp in self.inputs)
        outs = self.outputs if isinstance(self.outputs, tuple) else (self.outputs,)
        return f"({ins}) -> ({', '.join(map(repr, outs))})" + (f" [{self.local_fn}]" if self.local_fn else "")


def sig(outputs, /, local_fn: str | None = None, **inputs) -> Signature:
    """``Signature`` of tensor arguments by name: ``sig(S(0), self=S(0), mat2=B)`` is "rows of self, all of mat2
    give rows of the output"."""
    return Signature(tuple(inputs.items()), outputs, local_fn)


class NumberClass(enum.Enum):
    """What a rule may know of a Scalar-typed number it does not declare in ``reads``, and what the call key holds
    of it beside its type: whether a partial tensor can be scaled by it part by part. A factor keeps a partial sum
    exact only where it is finite, a divisor only where it is finite and nonzero (a part of 0 over 0 is nan, where
    the sum's quotient is an infinity)."""

    ZERO = "zero"
    FINITE = "finite, nonzero"
    NOT_FINITE = "inf or nan"


_NUMBERS = (bool, int, float, complex)


def number_class(value) -> NumberClass:
    """The class of a Python number (a bool counts as an integer; a complex number is finite where both parts are)."""
    if value == 0:
        return NumberClass.ZERO
    finite = cmath.isfinite(value) if isinstance(value, complex) else math.isfinite(value)
    return NumberClass.FINITE if finite else NumberClass.NOT_FINITE


def finite(value) -> bool:
    """Whether a number, or a ``NumberClass``, is finite (scaling a partial sum by it keeps it exact)."""
    value = value if isinstance(value, NumberClass) else number_class(value)
    return value is not NumberClass.NOT_FINITE


def finite_nonzero(value) -> bool:
    """Whether a number, or a ``NumberClass``, is finite and nonzero (dividing a partial sum by it keeps it exact)."""
    value = value if isinstance(value, NumberClass) else number_class(value)
    return value is NumberClass.FINITE


class UndeclaredArgument(KeyError):
    """A rule read a non-tensor argument it did not declare in ``reads``: its decision could then depend on a value
    the call key drops (see the module docstring)."""


_HIDDEN = object()


@dataclass
class OpCall:
    """An op call as a rule sees it. ``arguments`` maps schema names to values: ``TensorInfo`` for every tensor (global,
    or plain ones, which are taken as broadcast), tuples of them for lists of tensors, the declared non-tensor
    arguments as passed (defaults filled in). ``outputs`` are the tensor outputs; ``mesh_shape`` the placement's."""

    func: object
    arguments: dict
    outputs: tuple[TensorInfo, ...]
    mesh_shape: tuple[int, ...]
    global_names: frozenset = frozenset()  # the arguments that hold global tensors

    def __getitem__(self, name: str):
        value = self.arguments[name]
        if value is _HIDDEN:
            raise UndeclaredArgument(f"the SBP rule of {self.func} reads {name!r}, which it does not declare in reads=")
        return value

    def get(self, name: str, default=None):
        """The argument ``name``, or ``default`` where the op has no such argument or it is None."""
        value = self[name] if name in self.arguments else None
        return default if value is None else value

    def dim(self, name: str = "dim", of: str = "self", default: int = 0) -> int:
        """Argument ``name`` as a dim of tensor ``of``, counted from the front."""
        return normalize_dim(self.get(name, default), self[of].ndim)

    @property
    def inputs(self) -> dict:
        """The global tensor arguments by name, in schema order (a list argument as a tuple, None for elements that
        are not global)."""
        return {name: value for name, value in self.arguments.items() if name in self.global_names}

    def tensors(self) -> Iterator[tuple[str, TensorInfo]]:
        """(name, info) of every single tensor argument, global or plain, in schema order (not lists)."""
        return ((n, v) for n, v in self.arguments.items() if isinstance(v, TensorInfo))

    def tensor_names(self) -> list[str]:
        """The names of the arguments that hold a tensor or a list with tensors, in schema order."""
        return [
            n
            for n, v in self.arguments.items()
            if isinstance(v, TensorInfo) or (isinstance(v, (list, tuple)) and any(isinstance(x, TensorInfo) for x in v))
        ]


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
    """How to find the signatures of an op (or a family of ops): ``signatures`` as the rule writes them (``offered``
    adds the all-broadcast one), the non-tensor arguments it ``reads``, and what else it knows of the op."""

    signatures: Callable[[OpCall], list[Signature] | None]
    reads: frozenset = frozenset()
    check_nd: Callable[[OpCall, tuple[Signature, ...]], bool] | None = None
    local_fns: dict = field(default_factory=dict)  # name -> fn(func, LocalContext) -> the local outputs
    # Run on ranks outside the placement instead of the op, as fn(func, LocalContext): for effects every rank
    # must share, like advancing the random generator.
    outside: Callable | None = None
    # (OpCall without outputs) -> each output's TensorInfo, or None where running the op on meta tensors must tell.
    outputs: Callable | None = None

    def offered(self, call: OpCall) -> list[Signature]:
        """The rule's signatures for ``call``, with the all-broadcast one added at the end where the rule does not list
        it; none where the rule declines the call (returns None)."""
        signatures = self.signatures(call)
        if signatures is None:
            return []
        signatures = list(signatures)
        if not any(_all_broadcast(s) for s in signatures):
            signatures.append(Signature(tuple((name, B) for name in call.tensor_names()), B))
        return signatures


def _all_broadcast(signature: Signature) -> bool:
    # (the outputs first: most signatures split or reduce them, and that settles it)
    outputs = signature.outputs
    for s in outputs if isinstance(outputs, tuple) else (outputs,):
        if s is not None and s != B:
            return False
    for _, sbp in signature.inputs:
        for s in sbp if isinstance(sbp, tuple) else (sbp,):
            if s is not None and s != B:
                return False
    return True


RULES: dict = {}
_FAMILY_RULES: list[tuple[Callable, Rule]] = []


def _overloads(op) -> list:
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    return [op]


def _checked_reads(reads, ops) -> frozenset:
    """``reads`` as a set, after checking that each name is an argument of at least one of ``ops`` (a typo would
    otherwise leave the rule reading nothing and the key dropping what the rule means to read)."""
    names = {a.name for op in ops for overload in _overloads(op) for a in overload._schema.arguments}
    unknown = sorted(set(reads) - names) if ops else []
    if unknown:
        raise ValueError(f"a rule of {ops[0]} declares reads={unknown}, which none of its ops has")
    return frozenset(reads)


def register(*ops, reads=(), check_nd=None, local_fns=None, outside=None, outputs=None):
    """Decorator: the decorated function gives the 1-D signatures of ``ops`` (aten overloads or packets)."""

    def add(fn):
        rule = Rule(fn, _checked_reads(reads, ops), check_nd, local_fns or {}, outside, outputs)
        for op in ops:
            for overload in _overloads(op):
                RULES[overload] = rule
        return fn

    return add


def register_family(matches: Callable, reads=(), check_nd=None, local_fns=None):
    """Decorator for a rule that covers every op for which ``matches(op)`` is true (tried in order, after
    the ops registered by name)."""

    def add(fn):
        _FAMILY_RULES.append((matches, Rule(fn, frozenset(reads), check_nd, local_fns or {})))
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


def shown_arguments(func, by_name: dict, reads: frozenset, describe: Callable) -> dict:
    """The arguments of a call as its rule sees them (``OpCall.arguments``): tensors and lists of tensors through
    ``describe`` (a value -> its TensorInfo, or the value itself where it is not a tensor), the declared arguments as
    they are, every other one hidden."""
    shown = {}
    for name, holds_tensors, scalar in _argument_kinds(func):
        if name not in by_name:
            continue
        value = by_name[name]
        if holds_tensors:
            shown[name] = type(value)(map(describe, value)) if isinstance(value, (list, tuple)) else describe(value)
        elif name in reads:
            shown[name] = value
        elif scalar and isinstance(value, _NUMBERS):
            shown[name] = number_class(value)  # (what the key holds of it)
        elif (
            scalar
            and isinstance(value, (list, tuple))
            and all(isinstance(v, (bool, int, float, complex)) for v in value)
        ):
            shown[name] = tuple(map(number_class, value))
        else:
            shown[name] = _HIDDEN
    return shown


# id(op) -> (op, ((name, whether its type holds tensors, whether it is Scalar-typed), ...)): read from the schema
# once per op (reading a schema's types costs more than the rest of showing a call); the op is kept to check that
# its id was not reused
_KINDS: dict = {}


def _argument_kinds(func) -> tuple:
    entry = _KINDS.get(id(func))
    if entry is None or entry[0] is not func:
        kinds = tuple(
            (a.name, "Tensor" in str(a.type), str(a.type) in ("number", "List[number]")) for a in func._schema.arguments
        )
        entry = _KINDS[id(func)] = (func, kinds)
    return entry[1]


# What several families share


def operand_sbp(out_shape: tuple[int, ...], operand, dim: int):
    """The SBP an operand broadcast to ``out_shape`` needs so that the output can be split on ``dim`` (B for a
    number or an absent operand)."""
    if not isinstance(operand, TensorInfo):
        return B
    operand_dim = dim - (len(out_shape) - operand.ndim)
    if operand_dim < 0 or operand.shape[operand_dim] != out_shape[dim]:
        return B
    return S(operand_dim)


def pass_through(names, local_fn: str | None = None) -> list[Signature]:
    """``B -> B`` and each partial to itself, for the arguments ``names`` and every output."""
    return [Signature(tuple((n, s) for n in names), s, local_fn) for s in (B, *PARTIALS)]


def like_input(call: OpCall, local_fn: str | None = None, name: str = "self") -> list[Signature]:
    """Outputs shaped like input ``name``, whose values are not read: S(d) -> S(d) for each dim, B and partials -> B."""
    splits = [Signature(((name, S(d)),), S(d), local_fn) for d in range(call[name].ndim)]
    return splits + [Signature(((name, s),), B, local_fn) for s in (B, *PARTIALS)]


def floats_only(shape_rule: Callable) -> Callable:
    """An ``outputs`` rule applied only where the first tensor argument is float32 or float64, whose output dtypes are
    the input's on every device (elsewhere the op on meta tensors tells)."""

    def outputs(call: OpCall):
        first = call.arguments[call.tensor_names()[0]] if call.tensor_names() else None
        first = first[0] if isinstance(first, (list, tuple)) else first
        if not isinstance(first, TensorInfo) or first.dtype not in (torch.float32, torch.float64):
            return None
        return shape_rule(call)

    return outputs


def smallest_part(call: OpCall, combo: tuple, name: str, dim: int) -> int:
    """The extent of ``dim`` in the smallest local part of argument ``name`` under the N-D signature ``combo``
    (balanced splits: floor division per splitting axis)."""
    extent = call[name].shape[dim]
    for axis, signature in enumerate(combo):
        s = signature.sbp_of(name)
        if isinstance(s, Split) and s.dim == dim:
            extent //= call.mesh_shape[axis]
    return extent


def every_split_part_nonempty(call: OpCall, combo: tuple) -> bool:
    """A ``check_nd`` for ops whose local computations fail on empty parts (convolution, batch norm): every
    split must leave each rank at least one element of the split dim, or one rank would fail alone and leave
    the others waiting in the next collective."""
    return all(
        smallest_part(call, combo, name, sbp.dim) > 0
        for signature in combo
        for name, sbp in signature.inputs
        if isinstance(sbp, Split) and isinstance(call.arguments.get(name), TensorInfo)
    )
