"""An op call bound to its schema: where its global tensors are, which it reads and writes, its arguments by name, its
cache key. Every call is keyed (``call_key``: the cache's hit path), but bound (``BoundCall``) only when its key is new;
every later step of that first call reads the one ``BoundCall``. A plan keeps the slots, so a repeated call finds its
global tensors without binding (``at``, ``substitute``). A slot is ``(position or keyword, index in a list or None)``:
aten arguments nest at most one list deep."""

import itertools

import torch

from .._signatures import NumberClass, number_class
from .._tensor import GlobalTensor
from ._schema import OpSchema, op_schema


def _key_of(value, is_scalar: bool):
    if type(value) is GlobalTensor:  # the common cases first: this runs for every argument of every op
        return value._meta
    if isinstance(value, (list, tuple)):  # lists of global tensors (cat, foreach ops) keyed element by element
        return (type(value), tuple([v._meta if type(v) is GlobalTensor else _key_of(v, is_scalar) for v in value]))
    if isinstance(value, GlobalTensor):
        return value._meta
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type)
    if is_scalar and isinstance(value, (bool, int, float, complex)):
        return _SCALAR_KEYS[type(value), number_class(value)]
    if isinstance(value, (float, bool, complex)):  # (1, 1.0, True and 1+0j: equal keys, results of other dtypes)
        return (type(value), value)
    return value


# (type, class) of a Scalar-typed number, made once each: the key of every such argument
_SCALAR_KEYS = {(t, c): (t, c.value) for t in (bool, int, float, complex) for c in NumberClass}


def call_key(func, schema: OpSchema, args, kwargs) -> tuple:
    """The call's cache key: the op by id (an entry keeps the op to check it), global tensors by metadata, plain
    tensors by shape, dtype and device, Scalar-typed numbers that the op's rule does not read by type and
    ``NumberClass`` (a changing learning rate keys alike), other floats, bools and complex numbers by type and value,
    the rest by value. It may be unhashable (a slice, say): lookups catch that."""
    positions = schema.scalar_positions
    key = (id(func), *[_key_of(a, i in positions) for i, a in enumerate(args)])
    if kwargs:
        names = schema.scalar_names
        key += tuple([(k, _key_of(v, k in names)) for k, v in kwargs.items()])
    return key


def find_tensors(args, kwargs) -> tuple[tuple, tuple, list]:
    """(slots, tensors, plain): each global tensor argument's slot and itself, in order; the plain tensors with dims."""
    slots, tensors, plain = [], [], []
    for where, value in itertools.chain(enumerate(args), kwargs.items()):
        for index, v in enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]:
            if isinstance(v, GlobalTensor):
                slots.append((where, index))
                tensors.append(v)
            elif isinstance(v, torch.Tensor) and v.dim() > 0:
                plain.append(v)
    return tuple(slots), tuple(tensors), plain


def at(args, kwargs, slot):
    """The argument at ``slot``."""
    where, index = slot
    value = kwargs[where] if isinstance(where, str) else args[where]
    return value if index is None else value[index]


def substitute(args, kwargs, slots, values) -> tuple[list, dict]:
    """``(args, kwargs)`` with the argument at each of ``slots`` replaced by the matching one of ``values``
    (lists are copied, never changed in place)."""
    args, kwargs = list(args), dict(kwargs) if kwargs else {}
    copied = set()
    for (where, index), value in zip(slots, values):
        holder = kwargs if isinstance(where, str) else args
        if index is None:
            holder[where] = value
            continue
        if where not in copied:
            holder[where] = list(holder[where])
            copied.add(where)
        holder[where][index] = value
    return args, kwargs


def by_name(schema: OpSchema, args, kwargs) -> dict:
    """The call's arguments by schema name, defaults filled in."""
    named = dict(schema.defaults)
    named.update(zip(schema.names, args))
    named.update(kwargs)
    return named


class _memo:
    """``functools.cached_property`` without its lock (Python 3.11 takes one on every first read, a good part of
    binding a call): a ``BoundCall`` belongs to one thread."""

    def __init__(self, compute):
        self.compute, self.name, self.__doc__ = compute, compute.__name__, compute.__doc__

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        value = instance.__dict__[self.name] = self.compute(instance)  # later reads find it before this descriptor
        return value


class BoundCall:
    """``slots`` and ``tensors``: every global tensor argument and where it is, in argument order (a tensor passed
    twice appears twice: each occurrence gets its own layout), which ``inputs``, ``outs`` and ``written`` index;
    ``plain``: the plain tensors with dims among the arguments."""

    def __init__(self, func, args, kwargs, key=None):
        self.func, self.args, self.kwargs = func, tuple(args), dict(kwargs)
        self.schema = op_schema(func)
        self.key = key if key is not None else call_key(func, self.schema, args, kwargs)
        self.slots, self.tensors, self.plain = find_tensors(args, kwargs)

    @_memo
    def by_name(self) -> dict:
        return by_name(self.schema, self.args, self.kwargs)

    @_memo
    def _names(self) -> list[str]:
        return [self.schema.name_of(where) for where, _ in self.slots]

    @_memo
    def inputs(self) -> tuple[int, ...]:
        """Indices of the tensors the op reads: all but ``out=`` tensors."""
        return tuple(i for i, name in enumerate(self._names) if name not in self.schema.outs)

    @_memo
    def outs(self) -> tuple[int, ...]:
        """Indices of the ``out=`` tensors."""
        return tuple(i for i, name in enumerate(self._names) if name in self.schema.outs)

    @_memo
    def written(self) -> tuple[int, ...]:
        """Indices of the tensors the op writes into: the schema's, and ``UNMARKED_WRITES`` when its flag is on."""
        names = self.schema.written
        unmarked = self.schema.unmarked
        if unmarked is not None and self.by_name.get(unmarked[0]):
            names = names | frozenset(unmarked[1])
        return tuple(i for i, name in enumerate(self._names) if name in names)

    @property
    def placement(self):
        return self.tensors[0].placement

    def hashable_key(self):
        """The cache key, or None when it cannot be hashed (the call is then not cached)."""
        try:
            hash(self.key)
        except TypeError:
            return None
        return self.key
