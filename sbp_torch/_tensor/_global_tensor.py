"""GlobalTensor: a ``torch.Tensor`` subclass that reports the logical tensor and holds this rank's part;
its differentiable ways back to plain tensors (``to_local``, ``full_tensor``); the gradient rule on it.

The type knows nothing of how ops on it run: its torch entry points call the handlers given to ``connect``,
which ``sbp_torch/__init__.py`` calls once, the one place where this layer is wired to the layers above it."""

import functools
import hashlib
import pathlib

import torch

try:  # private API, used by _never_a_compiled_frame
    from torch._C._dynamo import eval_frame as _frames
except ImportError:
    _frames = None

from .._boxing import box_local
from .._comm import naming_cause, note_placement
from .._layout import GlobalMeta, broadcast, normalize_sbp
from ._gradient import gradient_part, gradient_sbp, has_extreme

_new_wrapper = torch.Tensor._make_wrapper_subclass


def _not_connected(*_):
    raise RuntimeError("sbp_torch's dispatcher is not connected: import sbp_torch itself, not only its parts")


class GlobalTensor(torch.Tensor):
    """A logical tensor laid out over the ranks of a placement by one SBP per placement axis. PyTorch sees the
    logical shape, stride and dtype; this rank's data is ``to_local()``. sbp_torch runs every op on it, picking a
    layout and inserting the collectives. Build one with ``Tensor.to_global`` or the creation functions, not
    directly."""

    _local: torch.Tensor
    _meta: GlobalMeta
    __slots__ = ("_local", "_meta")

    @staticmethod
    def __new__(cls, local: torch.Tensor, meta: GlobalMeta, requires_grad: bool = False):
        # The wrapper never carries a conjugate / negative bit, and inside __torch_dispatch__ torch no longer
        # honours them on the parts: a lazily conjugated part would be read unconjugated by the next op.
        if local.is_conj():
            local = local.resolve_conj()
        if local.is_neg():
            local = local.resolve_neg()
        # (positional: torch parses keywords of _make_wrapper_subclass more slowly, on every op's output)
        out = _new_wrapper(
            cls, meta.shape, meta.strides, None, None, meta.dtype, torch.strided, local.device, False, requires_grad
        )
        out._local = local
        out._meta = meta
        return out

    # Both entry points are the handlers given to ``connect``.
    __torch_function__ = classmethod(_not_connected)
    __torch_dispatch__ = classmethod(_not_connected)

    @property
    def placement(self):
        """The placement whose ranks hold this tensor."""
        return self._meta.placement

    @property
    def sbp(self) -> tuple:
        """One SBP per placement axis, as a tuple."""
        return self._meta.sbp

    def to_local(self, *, grad_sbp=None) -> torch.Tensor:
        """This rank's part (empty on a rank outside the placement). Differentiable; see ``sbp_torch.to_local``."""
        return to_local(self, grad_sbp=grad_sbp)

    def full_tensor(self) -> torch.Tensor:
        """The logical tensor as a plain tensor on every rank of the placement. Differentiable."""
        return full_tensor(self)

    # The value readers of a training loop give the logical value, like ``item()``; each is a collective (every
    # rank of the placement must call it). torch's own versions refuse tensor subclasses.
    def tolist(self):
        """The logical value as nested Python lists (a number for a 0-dim tensor)."""
        return full_tensor(self.detach()).tolist()

    def numpy(self, *, force: bool = False):
        """The logical value as a NumPy array; refuses a tensor that requires grad, as torch does."""
        return full_tensor(self).numpy(force=force)

    def __format__(self, spec: str) -> str:
        # f"{loss:.4f}" formats the logical number, as torch does for a 0-dim tensor
        return format(full_tensor(self.detach()), spec)

    def __repr__(self) -> str:
        # No collective here: repr must be safe to call on one rank only (printing, debuggers).
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"GlobalTensor({self._meta}{grad},\n  local={self._local!r})"

    def __tensor_flatten__(self):
        # The context carries the parameter mark (``mark_reduced_at_use``) into the tracer's copies. A compilation
        # that flattens a global tensor takes part in the check that the ranks' programs agree.
        note_placement(self._meta.placement)
        return ["_local"], (self._meta, reduced_at_use(self))

    @staticmethod
    def __tensor_unflatten__(inner, context, outer_size, outer_stride):
        meta, reduced = context
        out = GlobalTensor(inner["_local"], meta)
        if reduced:
            mark_reduced_at_use(out)
        return out

    def _stable_hash_for_caching(self) -> str:
        # torch.compile's on-disk cache may key a compiled program by its inputs' metadata. Ranks of one
        # placement see equal metadata but compile different programs (each keeps its own region), so the
        # key holds this rank's coordinate. It also holds the flatten context as written (meta, parameter mark):
        # the mark changes the compiled backward, and a cached program stores contexts in that form.
        # The key also holds a digest of sbp_torch's own source: the traced program is sbp_torch's decisions, so
        # a program compiled by another version of it must not be taken from the cache.
        local = self._local
        context = (self._meta, reduced_at_use(self), self._meta.placement.local_coord())
        shape = f"{tuple(local.shape)} {tuple(local.stride())} {local.dtype}"
        return f"sbp_torch {_source_digest()} (meta, reduced at use, coord) {context}: {shape}"

    def __coerce_tangent_metadata__(self):
        # torch.compile traces the backward with a guessed gradient for each output: guess the layout eager
        # autograd gives it (partial axes become broadcast, or partial sums for P(max|min)), whose part has the
        # same shape. The guess's part is contiguous, as an arriving gradient's is: a view's part may overlap
        # itself (unfold), and a traced gradient with such strides would be read through them at run time.
        target = gradient_sbp(self._meta.sbp)
        if target == self._meta.sbp and self._local.is_contiguous():
            return self
        return GlobalTensor(self._local.contiguous(), self._meta.with_sbp(target))

    @naming_cause(lambda *_, **__: _READ)
    def __coerce_same_metadata_as_tangent__(self, expected_context: tuple, expected_type=None):
        # A gradient that reaches a compiled backward in another layout than the traced one is boxed to it.
        expected = expected_context[0]
        if expected_type not in (None, GlobalTensor) or expected.placement != self._meta.placement:
            return None
        if expected.sbp == self._meta.sbp:
            return self
        return GlobalTensor(box_local(self._local, self._meta, expected.sbp), expected)


def plain_tangent_as_global(tangent: torch.Tensor, expected_context: tuple, expected_type=None):
    """A plain gradient that reaches a compiled backward where a global one was traced, as that global tensor.

    Installed as ``torch.Tensor.__coerce_same_metadata_as_tangent__``. Autograd hands a compiled backward a plain
    tensor of zeros (in the logical shape) for each of its outputs that the loss does not reach, such as the
    key/value cache a ``transformers`` model returns beside its loss. Every rank ran the same program, so every
    rank holds the same logical gradient: each keeps its own region of it. For any other expected type this
    answers None, which leaves torch's own error in place."""
    if expected_type is not GlobalTensor or type(tangent) is not torch.Tensor:
        return None
    meta = expected_context[0]
    if tuple(tangent.shape) != meta.shape:
        return None
    return from_whole(tangent.to(meta.dtype), meta)


def from_whole(value: torch.Tensor, meta: GlobalMeta) -> GlobalTensor:
    """The global tensor of ``meta`` whose logical value is ``value``, which every rank holds whole and equal: each
    rank keeps its own region, with no communication (a rank outside the placement keeps an empty part)."""
    if meta.placement.local_coord() is None:
        return GlobalTensor(value.new_empty(0), meta)
    whole = meta.with_sbp((broadcast,) * meta.placement.ndim)
    return GlobalTensor(value if meta == whole else box_local(value, whole, meta.sbp), meta)


@functools.cache
def _source_digest() -> str:
    """A digest of every Python source file of the sbp_torch package (read once, on first use)."""
    digest = hashlib.sha256()
    for path in sorted(pathlib.Path(__file__).parents[1].rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


# The attribute that marks a parameter whose gradient is reduced at each use while torch.compile traces.
_REDUCED_AT_USE = "_sbp_torch_gradient_reduced_at_use"


def mark_reduced_at_use(param: GlobalTensor) -> None:
    """Have each use of ``param`` in a traced program reduce that use's gradient to ``param``'s gradient layout,
    inside the compiled backward (``Module.to_global`` marks the parameters whose gradients it reduces)."""
    setattr(param, _REDUCED_AT_USE, True)


def reduced_at_use(x: torch.Tensor) -> bool:
    """Whether ``x`` is marked by ``mark_reduced_at_use``."""
    return getattr(x, _REDUCED_AT_USE, False)


def connect(torch_function, torch_dispatch, python_callees=()) -> None:
    """Make ``torch_function`` and ``torch_dispatch`` the type's ``__torch_function__`` and ``__torch_dispatch__``,
    each called as ``handler(cls, func, types, args=(), kwargs=None)``. Called once, by ``sbp_torch/__init__.py``;
    the handlers are the methods themselves, not called through a wrapper, because they run on every op. A handler
    written in C enters Python through ``python_callees``, which are then treated as the Python handlers are."""
    GlobalTensor.__torch_function__ = classmethod(torch_function)
    GlobalTensor.__torch_dispatch__ = classmethod(torch_dispatch)
    for fn in (torch_function, torch_dispatch, *python_callees):
        if hasattr(fn, "__code__"):
            _never_a_compiled_frame(fn)


def _never_a_compiled_frame(fn) -> None:
    """Have Dynamo run ``fn`` and what it calls as plain Python whenever it is entered as a frame of its own.

    Where a compiled function breaks its graph, the rest runs eagerly inside Dynamo's frame hook, and every op on
    a global tensor would enter a handler as a new frame: Dynamo would try to compile the handler itself, guard on
    each tensor's identity and recompile until its limit. When Dynamo traces a program it inlines
    ``__torch_function__`` instead, which this does not change. (Private API: without it, time is lost.)"""
    if _frames is not None:
        _frames.set_code_exec_strategy(
            fn.__code__, _frames._FrameExecStrategy(_frames._FrameAction.SKIP, _frames._FrameAction.SKIP)
        )


def wrap_fresh(local: torch.Tensor, meta: GlobalMeta) -> GlobalTensor:
    """``GlobalTensor(local, meta)`` for a part that is an op's new result (it carries no lazy conjugate or
    negative bit): the shorter constructor of the hot paths."""
    out = _new_wrapper(GlobalTensor, meta.shape, meta.strides, None, None, meta.dtype, torch.strided, local.device)
    out._local = local
    out._meta = meta
    return out


def gradient(grad: GlobalTensor, meta: GlobalMeta, saved_local: torch.Tensor | None) -> GlobalTensor:
    """The gradient of a tensor of ``meta`` from the gradient ``grad`` of the same logical tensor, laid out as
    ``gradient_sbp(meta.sbp)``. ``saved_local`` (the input's part) is needed only for P(max|min) axes."""
    if not isinstance(grad, GlobalTensor):
        raise TypeError(f"expected a global gradient for a global tensor, got a plain {type(grad).__name__}")
    local = gradient_part(grad._local, grad._meta, meta, saved_local)
    return GlobalTensor(local, grad._meta.with_sbp(gradient_sbp(meta.sbp)))


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g: GlobalTensor, grad_sbp: tuple):
        ctx.meta = g._meta.with_sbp(grad_sbp)
        return g._local.view_as(g._local)

    @staticmethod
    def backward(ctx, grad):
        return GlobalTensor(grad, ctx.meta), None


_READ = "full_tensor / to_local"


class _FullTensor(torch.autograd.Function):
    @staticmethod
    @naming_cause(lambda *_: _READ)
    def forward(ctx, g: GlobalTensor):
        ctx.meta = g._meta
        ctx.saved_local = g._local if has_extreme(g._meta) else None
        return box_local(g._local, g._meta, (broadcast,) * g._meta.placement.ndim)

    @staticmethod
    @naming_cause(lambda *_: _READ)
    def backward(ctx, grad):
        # Every rank is taken to hold the same gradient of the logical tensor (they ran the same program).
        replicated = ctx.meta.with_sbp((broadcast,) * ctx.meta.placement.ndim)
        if isinstance(grad, GlobalTensor):  # the full tensor met global tensors as a 0-dim operand
            grad = box_local(grad._local, grad._meta, replicated.sbp)
        if ctx.meta.placement.local_coord() is None:
            grad = grad.new_empty(0)
        return gradient(GlobalTensor(grad, replicated), ctx.meta, ctx.saved_local)


def to_local(x: GlobalTensor, *, grad_sbp=None) -> torch.Tensor:
    """This rank's part of ``x`` (an empty tensor on a rank outside the placement). Differentiable: the local
    gradient becomes a global gradient laid out as ``grad_sbp`` (default ``gradient_sbp(x.sbp)``: broadcast for
    broadcast and partial-sum tensors, so ranks must agree on it)."""
    if not isinstance(x, GlobalTensor):
        raise TypeError(f"to_local takes a global tensor, got a plain {type(x).__name__}")
    target = gradient_sbp(x.sbp) if grad_sbp is None else normalize_sbp(grad_sbp, x.placement, x.dim(), x.dtype)
    return _ToLocal.apply(x, target)


def full_tensor(x: GlobalTensor) -> torch.Tensor:
    """The logical tensor as a plain tensor on every rank of the placement (empty outside it)."""
    if not isinstance(x, GlobalTensor):
        raise TypeError(f"full_tensor takes a global tensor, got a plain {type(x).__name__}")
    return _FullTensor.apply(x)
