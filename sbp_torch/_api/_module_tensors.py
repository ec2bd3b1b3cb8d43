"""The parameter and buffer slots of a module tree, and swapping what they hold for a while."""

from __future__ import annotations

from typing import NamedTuple

from torch import nn


def module_tensors(module: nn.Module, prefix: str = ""):
    """Every parameter and buffer slot of ``module`` and its submodules, a shared tensor once per module holding
    it: (full dotted name under ``prefix``, whether it is a parameter, the holder's table, the name in it, the
    tensor). Empty slots are skipped; the caller may replace ``table[name]`` as it goes."""
    for sub_name, sub in module.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            table = getattr(sub, kind)
            for name, tensor in list(table.items()):
                if tensor is not None:
                    yield ".".join(filter(None, (prefix, sub_name, name))), kind == "_parameters", table, name, tensor


class Slot(NamedTuple):
    """One place a module holds a tensor: ``table[name]``, ``table`` a module's ``_parameters`` or ``_buffers``."""

    table: dict
    name: str

    def get(self):
        return self.table[self.name]

    def set(self, value) -> None:
        self.table[self.name] = value


class Swap:
    """``values`` put into ``slots``, and what the slots held before put back: as a ``with`` block, or by ``put()``
    and ``put_back()`` from a pair of hooks. A slot is anything with ``get()`` and ``set(value)`` (a ``Slot``,
    ``compile_step``'s state holders). Without ``values`` the slots are only kept: whatever the block puts in them
    is undone. Putting back runs in reverse order, so a tensor held in two slots ends where it was."""

    def __init__(self, slots, values=None):
        self.slots, self.values = list(slots), values
        self.before: list | None = None

    def put(self) -> None:
        self.before = [slot.get() for slot in self.slots]
        if self.values is not None:
            for slot, value in zip(self.slots, self.values, strict=True):
                slot.set(value)

    def put_back(self) -> None:
        if self.before is None:  # (nothing was put: ``put`` failed before reading the slots, or never ran)
            return
        for slot, value in reversed(list(zip(self.slots, self.before))):
            slot.set(value)
        self.before = None

    def __enter__(self) -> Swap:
        self.put()
        return self

    def __exit__(self, *_) -> None:
        self.put_back()
