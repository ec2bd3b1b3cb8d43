"""Ranks agree on what their compiled programs communicate, checked once per compilation.

Each rank compiles its own program with ``torch.compile``. A collective pairs the n-th call of each rank of its
group, so if the programs of two ranks differ in their collectives (kind, group, sizes, dtype, order), running
them would abort gloo ("Received data size doesn't match") or wait forever. So:

* every collective that AOTAutograd traces (forward and backward, in trace order) is recorded here, in the
  compilation that traces it (``record``); the backward compiled later, at the first backward call, was traced
  with the forward, so one record covers both;
* when Dynamo's compilation of a frame ends, the ranks that took part exchange their records, once, and each
  compares them group by group: the members of a group must issue the same sequence of collectives on it, with
  matching sizes. Every rank then raises the same ``RanksDisagree`` naming the first difference;
* metadata that ranks exchange while a program is traced (``to_global``'s parts) is exchanged once per
  compilation and reused by the later traces of the same call (``agree_while_compiling``).

Both exchanges go through the default group's key-value store, not a collective: a rank that compiles alone
(say a guard that failed on one rank only) must not meet the others' compiled collectives. A rank that waits
longer than the store's timeout for the others raises, and closes its process groups so that they raise too.
"""

import contextlib
import functools
import pickle
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch._guards import CompileContext
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from ._faults import close_world

# key-value store prefix; the store outlives a compiled program, so old keys are deleted as ranks move on
_PREFIX = "sbp_torch/compiled"


class RanksDisagree(RuntimeError):
    """The ranks compiled programs whose collectives differ, or one rank compiled where the others did not."""


class Traced(NamedTuple):
    """One collective as this rank's program issues it."""

    kind: str
    ranks: tuple[int, ...]  # its process group's ranks, sorted (torch's group order)
    dtype: str
    shape: tuple[int, ...]
    sends: tuple[int, ...] | None  # all-to-all: elements to each group rank, in group order
    receives: tuple[int, ...] | None

    def __str__(self) -> str:
        if self.sends is None:
            return f"{self.kind} of a {self.dtype} {self.shape}"
        return f"{self.kind} of {self.dtype} sending {list(self.sends)} and receiving {list(self.receives)} elements"


def compiling() -> bool:
    """Whether ``torch.compile`` traces the running code: Dynamo (``is_compiling``), or AOTAutograd and the
    backends under Dynamo's compilation (torch 2.11 holds ``is_compiling`` false there)."""
    return torch.compiler.is_compiling() or CompileContext.current_compile_id() is not None


class _Compilation:
    """What one compilation recorded: every collective traced (Dynamo's run included), those that AOTAutograd
    traced into the graphs, and the metadata agreed."""

    def __init__(self):
        self.ranks: set[int] = set()  # the placements this compilation communicates on
        self.graphs: list[Traced] = []
        self.agreed: dict = {}


# The running compilation's record: Dynamo compiles one frame at a time (under its compile lock), and a
# compilation's id may change while it runs (a restarted analysis counts as another attempt).
_compilation: list[_Compilation | None] = [None]
_sequence: dict[tuple, int] = {}  # (topic, ranks) -> how many exchanges this rank made


def _current() -> _Compilation:
    """The record of the running compilation; makes sure its end is reported to ``_on_compile_end``."""
    callbacks = _dynamo_callbacks()
    if _on_compile_end not in callbacks.end_callbacks:  # (``torch._dynamo.reset`` clears them)
        callbacks.register_end_callback(_on_compile_end)
    if _compilation[0] is None:
        _compilation[0] = _Compilation()
    return _compilation[0]


@functools.cache
def _dynamo_callbacks():
    from torch._dynamo.callback import callback_handler  # (imported once a program compiles: Dynamo is loaded)

    return callback_handler


def record(kind: str, group, tensor: torch.Tensor, sends=None, receives=None) -> None:
    """Note the collective ``kind`` on the ``AxisGroup`` ``group`` that this rank's compiled program issues on
    ``tensor`` (what it puts in); nothing unless a compilation runs."""
    if CompileContext.current_compile_id() is None:
        return
    compilation = _current()
    placement = group.placement
    compilation.ranks.update(group.ranks if placement is None else placement.flat_ranks)
    if get_proxy_mode() is None:  # Dynamo's run on fake parts, or AOTAutograd's analysis: no graph is made
        return
    as_tuple = lambda counts: None if counts is None else tuple(int(c) for c in counts)  # noqa: E731
    shape = tuple(int(s) for s in tensor.shape)
    entry = Traced(kind, tuple(sorted(group.ranks)), str(tensor.dtype), shape, as_tuple(sends), as_tuple(receives))
    compilation.graphs.append(entry)


def note_placement(placement) -> None:
    """Have the running compilation, if any, take part in the check with the ranks of ``placement``, which one of
    its global tensors lives on: a program on global tensors takes part even where it issues no collective."""
    if CompileContext.current_compile_id() is not None:
        _current().ranks.update(placement.flat_ranks)


def agree_while_compiling(key, value) -> list:
    """Every rank's ``value`` (rank order) for the call ``key`` of this rank's running compilation: exchanged over
    the world the first time, and the same answer for the later traces of the compilation (Dynamo's run, then
    AOTAutograd's). ``key`` holds all this rank's call depends on, so no other call reuses the answer."""
    compilation = _current()
    world = tuple(range(dist.get_world_size()))
    compilation.ranks.update(world)
    if key not in compilation.agreed:
        compilation.agreed[key] = _exchange("agree", world, value, what=f"{key[0]} inside a compiled program")
    return compilation.agreed[key]


def _on_compile_end(args) -> None:
    if args.callback_trigger.name != "DYNAMO":  # (a lazy backward was traced with its forward)
        return
    compilation, _compilation[0] = _compilation[0], None
    if compilation is None or len(compilation.ranks) < 2 or dist.get_rank() not in compilation.ranks:
        return
    ranks = tuple(sorted(compilation.ranks))
    prints = _exchange("collectives", ranks, compilation.graphs, what="a compiled program")
    problem = first_difference(dict(zip(ranks, prints)))
    if problem is not None:
        # Dynamo runs this callback before it counts the compilation as ended, and does not count it if the
        # callback raises: count it here, or no later compilation would run its callbacks.
        handler, pending = _dynamo_callbacks(), "_CompilationCallbackHandler__pending_callbacks_counter"
        if getattr(handler, pending, None) == 1:
            setattr(handler, pending, 0)
        raise RanksDisagree(
            f"the ranks compiled programs whose collectives differ, so they cannot run: {problem}. Every rank "
            "must run the same program on layouts that agree; a program whose collectives depend on the rank's "
            "own values (its part's size, data) cannot be compiled"
        )


def _exchange(topic: str, ranks: tuple[int, ...], value, what: str) -> list:
    """Every one of ``ranks``' ``value`` (in that order), through the default store; ``what`` for messages."""
    store = dist.distributed_c10d._get_default_store()
    me = dist.get_rank()
    counter = (topic, ranks)
    sequence = _sequence.get(counter, 0)
    _sequence[counter] = sequence + 1
    prefix = f"{_PREFIX}/{topic}/{'-'.join(map(str, ranks))}"
    keys = [f"{prefix}/{sequence}/{r}" for r in ranks]
    store.set(keys[ranks.index(me)], pickle.dumps(value))
    try:
        store.wait(keys)
    except (RuntimeError, ValueError) as err:  # the store's timeout: some rank never came
        missing = "some"
        with contextlib.suppress(RuntimeError, ValueError):
            missing = [r for r, key in zip(ranks, keys) if not store.check([key])]
        error = RanksDisagree(
            f"{what}: rank(s) {missing} did not take part in the exchange of ranks {list(ranks)} while compiling "
            f"(waited {store.timeout}): every rank must compile the same programs in the same order. A rank that "
            "compiles alone ran a program in a layout or shape the others did not, or found it in a compile "
            f"cache the others did not have (this rank's exchange #{sequence} of {topic})"
        )
        close_world(str(error), error)
        raise error from err
    values = [pickle.loads(v) for v in store.multi_get(keys)]
    if sequence:  # every rank has read the previous exchange, since every rank wrote this one
        with contextlib.suppress(RuntimeError, ValueError):
            store.delete_key(f"{prefix}/{sequence - 1}/{me}")
    return values


def first_difference(prints: dict[int, list[Traced]]) -> str | None:
    """The first collective on which the ranks' programs ``prints`` (rank -> its collectives in order) differ,
    described, or None."""
    by_group: dict[tuple[int, ...], dict[int, list]] = {}
    for rank, entries in prints.items():
        for index, entry in enumerate(entries):
            by_group.setdefault(entry.ranks, {}).setdefault(rank, []).append((index, entry))
    for ranks, issued in sorted(by_group.items()):
        members = [r for r in ranks if r in prints]
        for k in range(max(len(issued.get(r, ())) for r in members)):
            got = {r: issued[r][k] if k < len(issued.get(r, ())) else None for r in members}
            if _mismatch(ranks, {r: g and g[1] for r, g in got.items()}):
                lines = "; ".join(
                    f"rank {r} issues {'nothing more' if g is None else f'{g[1]} (its collective #{g[0]})'}"
                    for r, g in got.items()
                )
                return f"collective #{k} on the group of ranks {list(ranks)}: {lines}"
    return None


def _mismatch(ranks: tuple[int, ...], got: dict[int, Traced | None]) -> bool:
    entries = list(got.values())
    if any(e is None for e in entries):
        return True
    if len({(e.kind, e.dtype) for e in entries}) > 1:
        return True
    if entries[0].sends is None:
        return len({e.shape for e in entries}) > 1
    # an all-to-all: what each rank sends to another is what that one receives from it
    at = {r: ranks.index(r) for r in got}
    return any(got[a].sends[at[b]] != got[b].receives[at[a]] for a in got for b in got)
