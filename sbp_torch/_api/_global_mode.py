"""Global mode: within ``global_mode(placement, sbp)`` torch's factories return global tensors on that placement.

Model code builds tensors of its own inside ``forward`` (positions from ``torch.arange``, masks from ``torch.full``,
``torch.ones`` for a default attention mask). Every rank runs the same code on the same logical shapes and scalars,
so each such tensor holds the same values on every rank: taking it as a global tensor (broadcast by default) is
exact. ``Module.to_global`` turns this mode on around each call of the module it lays out.

Which functions are factories, and how each builds its value, is the table ``FACTORIES``. Random factories draw
from sbp_torch's layout-independent generator, so they too agree across ranks (given equal seeds). A factory asked
for a device of another type than the placement's (``"meta"``, say) builds the plain tensor it was asked for, and
``*_like`` of a global tensor is that tensor's own op, unchanged. Factories that sbp_torch's own code calls (a
conversion's buffers, inside a forward) build plain tensors, as outside the mode.
"""

import contextlib
import sys

import torch
from torch.overrides import (
    TorchFunctionMode,
    _len_torch_function_stack,
    _pop_torch_function_stack,
    _push_on_torch_function_stack,
)
from torch.utils import _pytree as pytree

from .._comm import compiling
from .._layout import Placement, Split, broadcast
from .._tensor import OWN_DIR, TORCH_DIR, GlobalTensor, first_outside
from ._factories import _from_value, _random, _size
from ._to_global import from_replica


class GlobalMode(TorchFunctionMode):
    """``global_mode``'s torch function mode; every call other than a factory's passes through unchanged."""

    def __init__(self, placement: Placement, sbp, parts_on_meta: bool = False, on_factory=None):
        super().__init__()
        if not isinstance(placement, Placement):
            raise TypeError(f"placement must be an sbp_torch.placement, got {type(placement).__name__}")
        self.placement = placement
        self.sbp = sbp
        # the planner traces on global tensors whose parts are on the meta device: factories build those too
        self.parts_on_meta = parts_on_meta
        # called with (func, args, kwargs, result) after each factory built: the planner follows their values
        self.on_factory = on_factory

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        build = FACTORIES.get(func)
        if build is None and _FACTORIES_BYPASS_MODES_UNDER_DYNAMO and compiling():
            args, kwargs = self._factory_values_as_global(args, kwargs)
        if (
            build is None
            or "out" in kwargs
            or (func in _LIKE and isinstance(args[0], GlobalTensor))  # a global tensor's own op
            or not self._builds_here(kwargs.get("device"))
            or (not compiling() and _called_by_sbp_torch())
        ):
            return func(*args, **kwargs)
        result = build(self, func, args, dict(kwargs))  # (a copy: building edits it)
        if self.on_factory is not None:
            self.on_factory(func, args, kwargs, result)
        return result

    def _factory_values_as_global(self, args, kwargs):
        """Dynamo of torch 2.11 records ``arange``, ``eye``, ``linspace``, ``tensor`` and other factories without
        calling the torch function modes, so their values reach the program plain. Where a plain tensor meets a
        global tensor, it is taken as the mode would have built it: the same value on every rank, of which each
        keeps its region. (Placements are not compared here: 2.11's Dynamo cannot trace reading one; an op on two
        placements refuses itself.)"""
        leaves = pytree.tree_leaves((args, kwargs))
        if not any(isinstance(a, GlobalTensor) for a in leaves):
            return args, kwargs

        def as_global(t: torch.Tensor) -> torch.Tensor:
            if isinstance(t, GlobalTensor) or t.dim() == 0:
                return t
            return from_replica(t, self.placement, self.sbp_for(t.dim()))

        return pytree.tree_map_only(torch.Tensor, as_global, (args, kwargs))

    def _builds_here(self, device) -> bool:
        kind = None if device is None else torch.device(device).type
        return kind is None or kind == self.placement.type or (self.parts_on_meta and kind == "meta")

    def sbp_for(self, ndim: int) -> tuple:
        """The mode's SBP for a new tensor; a split the tensor has no dim for is broadcast instead."""
        sbp = self.sbp if isinstance(self.sbp, tuple) else (self.sbp,) * self.placement.ndim
        return tuple(broadcast if isinstance(s, Split) and not -ndim <= s.dim < ndim else s for s in sbp)


def _value(mode: GlobalMode, func, args, kwargs):
    """Build the whole value on this rank, then keep this rank's part of it."""
    if func in _FROM_DATA and _holds_tensors(args[0] if args else kwargs.get("data")):
        return func(*args, **kwargs)  # a copy of a tensor it was given: one rank's value, which stays plain
    requires_grad = kwargs.pop("requires_grad", False)
    kwargs["device"] = "meta" if mode.parts_on_meta else mode.placement.device()
    value = func(*args, **kwargs)
    if not compiling():
        return _from_value(value, mode.placement, mode.sbp_for(value.dim()), requires_grad)
    if requires_grad:
        raise NotImplementedError(
            f"{func.__name__}(requires_grad=True) under global mode inside a compiled program: a leaf is made "
            "eagerly only; make it before the compiled call"
        )
    return from_replica(value, mode.placement, mode.sbp_for(value.dim()))  # what torch.compile can trace


def _random_factory(kind: str):
    def build(mode: GlobalMode, func, args, kwargs):
        if compiling():
            # The generator's position advances in Python: a traced program would draw the same values each call.
            raise NotImplementedError(
                f"{func.__name__} under global mode inside a compiled program: sbp_torch's layout-independent "
                "generator runs eagerly only; draw the values before the compiled call and pass them in"
            )
        if func in _LIKE:
            size, dtype = tuple(args[0].shape), kwargs.get("dtype") or args[0].dtype
        else:
            size, dtype = _size(args if args else (kwargs["size"],)), kwargs.get("dtype")
        if kwargs.get("generator") is not None:
            raise TypeError(
                f"{func.__name__} under global mode: a generator of this rank's own cannot give values that agree "
                "across ranks; leave generator out (sbp_torch's generator follows torch.manual_seed)"
            )
        sbp = mode.sbp_for(len(size))
        return _random(kind, size, mode.placement, sbp, dtype, kwargs.get("requires_grad", False))

    return build


def _on_cpu_only(mode: GlobalMode, func, args, kwargs):
    """Random integers come from torch's generator, which agrees across ranks with equal seeds on CPU only."""
    if mode.placement.type != "cpu":
        raise NotImplementedError(
            f"{func.__name__} under global mode on a {mode.placement.type} placement: its values would "
            "differ between ranks; draw it before the forward and pass it in with to_global"
        )
    return _value(mode, func, args, kwargs)


def _called_by_sbp_torch() -> bool:
    """Whether the factory call comes from sbp_torch's own code (a conversion's buffers, say), directly or through
    torch's Python code (``torch.distributed``): those tensors are this rank's own and stay plain."""
    frame, _ = first_outside(sys._getframe(2), (TORCH_DIR,))
    return frame is not None and frame.f_code.co_filename.startswith(OWN_DIR)


def _holds_tensors(data) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    return isinstance(data, (list, tuple)) and any(_holds_tensors(d) for d in data)


# (torch 2.13's Dynamo sends every factory to the modes; 2.11's only ones, zeros, empty, full and some _like forms)
_FACTORIES_BYPASS_MODES_UNDER_DYNAMO = tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13)

_LIKE = {torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like, torch.rand_like, torch.randn_like}
_FROM_DATA = {torch.tensor, torch.as_tensor}

# Each factory torch function and how it is built under global mode.
FACTORIES = {
    **dict.fromkeys(
        [torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.eye, torch.linspace, torch.logspace]
        + [torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.tril_indices, torch.triu_indices]
        + [torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like],
        _value,
    ),
    torch.rand: _random_factory("uniform"),
    torch.rand_like: _random_factory("uniform"),
    torch.randn: _random_factory("normal"),
    torch.randn_like: _random_factory("normal"),
    torch.randint: _on_cpu_only,
    torch.randperm: _on_cpu_only,
}


def global_mode(placement: Placement, sbp=broadcast) -> GlobalMode:
    """Within ``with global_mode(placement, sbp):``, torch's factories (``arange``, ``zeros``, ``ones``, ``full``,
    ``empty``, ``eye``, ``linspace``, ``tensor``/``as_tensor`` of Python data, ``*_like`` of plain tensors, and
    the random factories) return global tensors on ``placement`` with ``sbp`` (one SBP for every placement axis,
    or a tuple; a split along a dim the new tensor lacks is broadcast). Random values come from sbp_torch's
    layout-independent generator. Everything else runs as it would outside the block. Modes nest; the innermost
    wins."""
    return GlobalMode(placement, sbp)


@contextlib.contextmanager
def outside_global_mode():
    """Within the block no global mode is active, whatever the caller's: code that runs on local parts (a
    ``local_map`` region) builds plain tensors with torch's factories. Other torch function modes stay."""
    popped = []
    while _len_torch_function_stack():
        popped.append(_pop_torch_function_stack())
    kept = [mode for mode in reversed(popped) if not isinstance(mode, GlobalMode)]
    for mode in kept:
        _push_on_torch_function_stack(mode)
    try:
        yield
    finally:
        for _ in kept:
            _pop_torch_function_stack()
        for mode in reversed(popped):
            _push_on_torch_function_stack(mode)
