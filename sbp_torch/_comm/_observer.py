"""Who is told of each collective a context issues, and why it is issued.

``explain`` and the planner observe: they run a step (on fake or meta parts) inside ``observing`` and are called
before each collective with its kind, group and size. The code that knows why a collective is needed names the cause
(``naming_cause`` on a function, ``caused_by`` around a block); the innermost cause named is the one an observer
reads (``cause()``). Causes are context variables, so they follow the code that set them and nothing else, and they
are set only while someone observes: an unobserved call pays one lookup. Dynamo, which cannot trace a context
variable, is never shown one: while it traces, nothing observes, and the functions named run as they are."""

import contextlib
import contextvars
import functools
from collections.abc import Callable
from typing import NamedTuple

from torch.compiler import is_compiling

from ._groups import AxisGroup

# None, or (callback, whether the context only estimates): see ``observing``.
_OBSERVER: contextvars.ContextVar = contextvars.ContextVar("sbp_torch_collective_observer", default=None)
# None, or a string or a callable giving one: the innermost cause named (``caused_by``).
_CAUSE: contextvars.ContextVar = contextvars.ContextVar("sbp_torch_collective_cause", default=None)
UNNAMED = "boxing"  # the cause of a collective issued where no code named one


class DataDependent(NamedTuple):
    """What a collective whose size depends on values (tokens routed to experts) puts in, told to an observer: not
    known, but ``estimate`` bytes if the values fall evenly (each expert gets as many rows), which the planner
    prices; ``explain`` lists the collective as data-dependent."""

    estimate: int


@contextlib.contextmanager
def observing(callback, estimate: bool = False):
    """Within the block, call ``callback(kind, group, bytes this rank puts in)`` before each collective this context
    issues. ``estimate``: the block runs a step only to see what it would do, on fake or meta parts, and throws its
    results away (``estimating()``); its collectives are the functional ops a traced program holds, which move
    nothing there."""
    token = _OBSERVER.set((callback, estimate))
    try:
        yield
    finally:
        _OBSERVER.reset(token)


def observed() -> bool:
    """Whether someone observes this context's collectives."""
    return _OBSERVER.get() is not None


def estimating() -> bool:
    """Whether the running code only estimates a step (``observing(..., estimate=True)``: ``explain``, the
    planner), whose results nobody keeps. Only there may code that needs values it does not have (routing counts)
    stand in for them. A step traced into a program also runs on fake parts, but its results are the program:
    there, code must take the path that computes, and whether a part is fake tells nothing."""
    observer = _OBSERVER.get()
    return observer is not None and observer[1]


def notify(kind: str, group: AxisGroup, nbytes) -> None:
    """Tell the observer, if any, of the collective ``kind`` into which this rank puts ``nbytes()`` bytes."""
    observer = _OBSERVER.get()
    if observer is not None:
        observer[0](kind, group, nbytes())


@contextlib.contextmanager
def caused_by(describe: str | Callable[[], str]):
    """Within the block, the collectives issued are caused by ``describe`` (a string, or a function giving one when
    an observer asks), unless code inside names another cause. Outside an observer it names nothing."""
    if is_compiling() or _OBSERVER.get() is None:
        yield
        return
    token = _CAUSE.set(describe)
    try:
        yield
    finally:
        _CAUSE.reset(token)


def naming_cause(describe: Callable[..., str]):
    """Decorate a function whose collectives are caused by ``describe(*its arguments)``, read only when an observer
    asks (a hot path pays one lookup)."""

    def decorate(fn):
        @functools.wraps(fn)
        def named(*args, **kwargs):
            if is_compiling() or _OBSERVER.get() is None:
                return fn(*args, **kwargs)
            token = _CAUSE.set(lambda: describe(*args, **kwargs))
            try:
                return fn(*args, **kwargs)
            finally:
                _CAUSE.reset(token)

        return named

    return decorate


def cause() -> str:
    """The cause of a collective issued now: the innermost one named, else ``UNNAMED``."""
    describe = _CAUSE.get()
    if describe is None:
        return UNNAMED
    return describe if isinstance(describe, str) else describe()
