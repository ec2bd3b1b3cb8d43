"""The values a trace on meta parts can still know, so that a model that reads a value in its forward can be planned.

Planning runs a step on global tensors whose parts have no storage. Some models read a value on the way
(``transformers`` with ``use_cache=False`` checks whether the position ids describe packed sequences: a Python
branch on a tensor). Such a value rarely depends on the parameters: it comes from the example batch, or from a
factory (``arange``, ``ones``) and the ops after it. ``KnownValues`` follows exactly those: the batch's logical
values, each deterministic factory's, and every op whose tensor inputs are all known, computed again on the plain
values beside the trace, while they are small. A read of a known tensor (``item()``, ``bool()``) answers from its
value; a read of any other raises ``ValueReadInPlanning``, naming the line that reads.

Values are logical (the whole tensor), as global ops are: the result is the same on every rank whatever the layout.
An op that writes into a known tensor from unknown inputs makes that tensor, and everything sharing its storage,
unknown from then on."""

from __future__ import annotations

import math
import sys

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from .._tensor import OWN_DIR, TORCH_DIR, GlobalTensor, first_outside

LIMIT = 1 << 16  # the most elements a known value may have: beyond it the trace forgets it (it costs real compute)

# Factories whose values depend on their arguments alone (``empty`` and the random ones do not).
DETERMINISTIC_FACTORIES = frozenset(
    [torch.arange, torch.zeros, torch.ones, torch.full, torch.eye, torch.linspace, torch.logspace]
    + [torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.tril_indices, torch.triu_indices]
)

# Calls that hand a tensor's value to Python: answered from a known value, refused otherwise.
VALUE_READS = frozenset(
    [torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__, torch.Tensor.__float__]
    + [torch.Tensor.__index__, torch.Tensor.equal, torch.equal, torch.is_nonzero]
)
_aten = torch.ops.aten
# The same reads as aten ops, as the trace's dispatch sees them on the parts: reached only when a read was not
# answered above (the part is a meta tensor; the read is refused).
PART_READS = frozenset([_aten._local_scalar_dense.default, _aten.is_nonzero.default, _aten.equal.default])
# Ops whose result does not depend on the values of their tensor inputs (only on shapes and dtypes).
VALUE_FREE = frozenset(
    [_aten.new_zeros.default, _aten.new_ones.default, _aten.new_full.default]
    + [_aten.zeros_like.default, _aten.ones_like.default, _aten.full_like.default]
)


class ValueReadInPlanning(RuntimeError):
    """The model reads a value the planner cannot know (it depends on the parameters, on random draws, or is too
    large to follow); the message names the line."""


class KnownValues:
    """Global tensor -> its logical value as a plain CPU tensor, for the tensors of a trace whose values are known."""

    def __init__(self):
        self.values = WeakIdKeyDictionary()
        self.overwritten: set = set()  # storages of known values that an op wrote into with unknown inputs

    def add(self, tensor: GlobalTensor, value: torch.Tensor) -> None:
        fits = value.numel() <= LIMIT and value.device.type != "meta"
        if fits and tuple(value.shape) == tuple(tensor.shape) and value.dtype == tensor.dtype:
            self.values[tensor] = value

    def value_of(self, a):
        """The plain value standing for ``a`` (a global tensor, or anything else as it is); None when unknown."""
        if isinstance(a, GlobalTensor):
            value = self.values.get(a)
            if value is None or StorageWeakRef(value.untyped_storage()) in self.overwritten:
                return None
            return value
        if isinstance(a, torch.Tensor) and a.device.type == "meta":
            return None
        return a

    def factory_built(self, func, args, kwargs, out) -> None:
        """Global mode built ``out`` by the factory ``func``: its value too, as a plain CPU tensor, where the factory
        is deterministic and took no tensor."""
        if func not in DETERMINISTIC_FACTORIES or not isinstance(out, GlobalTensor) or math.prod(out.shape) > LIMIT:
            return
        if any(isinstance(a, torch.Tensor) for a in tree_flatten((args, kwargs))[0]):
            return
        plain_kwargs = {k: v for k, v in kwargs.items() if k != "requires_grad"}
        with torch._C.DisableTorchFunction():
            # (a copy: as_tensor may share the caller's memory, and ops of the trace may write into it)
            self.add(out, func(*args, **{**plain_kwargs, "device": "cpu"}).clone())

    def after_op(self, func, args, kwargs, out) -> None:
        """Follow ``func``'s outputs where every tensor input is known; forget what it wrote into otherwise."""
        value_free = func in VALUE_FREE
        if not self.values and not value_free:  # (most ops of a trace: nothing to follow, nothing to forget)
            return
        tensors = list(_tensors(args, kwargs))
        inputs = [self.value_of(a) for a in tensors]
        if not value_free and (None in inputs or torch.Tag.nondeterministic_seeded in func.tags):
            if any(v is not None and v is not a for v, a in zip(inputs, tensors)):
                self._forget_written(func, args, kwargs)  # (only a known input can be written and forgotten)
            return
        outputs = list(_tensors((out,), {}))
        globals_ = [o for o in outputs if isinstance(o, GlobalTensor)]
        if not globals_ or any(math.prod(o.shape) > LIMIT for o in globals_):
            self._forget_written(func, args, kwargs)
            return
        plain = tree_map(_stand_in if value_free else self.value_of, (args, kwargs))
        try:
            result = func(*plain[0], **plain[1])
        except Exception:  # noqa: BLE001 - following values is best effort: what it cannot redo stays unknown
            self._forget_written(func, args, kwargs)
            return
        for o, value in zip(outputs, _tensors((result,), {})):  # (the plain result, tensor by tensor)
            if isinstance(o, GlobalTensor):
                self.add(o, value)

    def read(self, func, args, kwargs):
        """``func`` (a value read) answered from the known values of its arguments."""
        plain = tree_map(self.value_of, (args, kwargs))
        if any(v is None for v in tree_flatten(plain)[0]):
            refuse_read(func)
        with torch._C.DisableTorchFunction():
            return func(*plain[0], **plain[1])

    def _forget_written(self, func, args, kwargs) -> None:
        for i, argument in enumerate(func._schema.arguments):
            a = args[i] if i < len(args) else kwargs.get(argument.name)
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = self.value_of(a)
                if isinstance(a, GlobalTensor) and value is not None:
                    self.overwritten.add(StorageWeakRef(value.untyped_storage()))


def refuse_read(func):
    """Raise ``ValueReadInPlanning`` for the read ``func``, naming the first line outside sbp_torch and torch."""
    frame, _ = first_outside(sys._getframe(), (OWN_DIR, TORCH_DIR))
    where = "an unknown line" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"
    name = getattr(func, "__name__", str(func))
    raise ValueReadInPlanning(
        f"planning traces without data, and the model reads a tensor's value ({name}) at {where}: a value that "
        "depends on the parameters, on random draws or on more than the example batch and factories. Make that "
        "branch not depend on it (pass the input that decides it, e.g. an attention mask), or lay the model out "
        "by hand"
    )


def _tensors(args, kwargs):
    """The tensors among ``args`` and ``kwargs``' values, and in lists or tuples among them (as aten ops take them)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def _stand_in(a):
    """Any plain tensor of ``a``'s shape and dtype (for ops that read no values)."""
    if isinstance(a, torch.Tensor):
        return torch.zeros(tuple(a.shape), dtype=a.dtype)
    return a


class AnswerReads(TorchFunctionMode):
    """Answers the model's reads of known values (``KnownValues.read``); everything else passes through."""

    def __init__(self, known: KnownValues):
        super().__init__()
        self.known = known

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in VALUE_READS and any(isinstance(a, GlobalTensor) for a in args):
            return self.known.read(func, args, kwargs)
        return func(*args, **kwargs)
