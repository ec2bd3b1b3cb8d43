"""At each call of a compiled step, each rank says which of its programs it runs, or that it traces a new one.

Every rank traces a step's programs together, so a program's number (the step's traces so far when it was traced)
is the same on every rank, and at each call every rank must run the same number or all trace. Two ways out of step:

* a rank tracing where the others run their programs (what a program is traced for changed on it alone: eval mode,
  a hyperparameter, ``reset()``) would wait for their trace while they wait in their collectives for it, until a
  timeout; so before it traces, it reads the others' posts for that call (``ranks_running``);
* ranks running programs of different numbers (a rank alone switched to another program it holds) pair
  collectives of different programs, which gives wrong values or waits; so after its program ran, a rank reads
  the posts of the ranks it ran with (``programs_run``): their collectives have met its own, so they have posted.

Either way the rank that finds it raises at once and closes its process groups, so that the others' collectives
fail at once too (``_faults.py``). Each post is one write that waits for no one, under one key per step and rank,
overwritten at each call; a step's name is posted once, when it is made, so that ranks that made their steps in
different orders raise at their first trace rather than wait for posts under the wrong step."""

import time

import torch.distributed as dist

from ._compiled import RanksDisagree
from ._faults import close_world

_PREFIX = "sbp_torch/step_calls"
_FIRST_PAUSE, _LONGEST_PAUSE = 0.001, 0.05  # seconds between reads while some rank has not reached the call


def _store():
    return dist.distributed_c10d._get_default_store()


def _keys(step: int, suffix: str = "") -> list[str]:
    return [f"{_PREFIX}/{step}/{rank}{suffix}" for rank in range(dist.get_world_size())]


def _raise(error: RanksDisagree):
    close_world(f"RanksDisagree: {error}", error)
    raise error


def announce_step(step: int, name: str) -> None:
    """Post the name of the step made ``step``-th on this rank (the order must be the same on every rank)."""
    _store().set(_keys(step, "/name")[dist.get_rank()], name)


def announce_call(step: int, call: int, program: int) -> None:
    """Post that this rank makes call #``call`` (counted alike on every rank) of ``step`` by running its program
    number ``program``, or by tracing a new one (``program`` 0)."""
    _store().set(_keys(step)[dist.get_rank()], f"{call} {program}")


def ranks_running(step: int, call: int, what: str) -> list[int]:
    """The ranks that run a program at call #``call`` of ``step`` (or went past it: a program with no collective),
    where this rank traces one; waits until every rank has announced the call. Where the ranks made their steps in
    different orders, or a rank does not make the call within the store's timeout, this rank raises
    ``RanksDisagree`` (``what`` names the step), its world closed."""
    store = _store()
    try:
        names = [name.decode() for name in store.multi_get(_keys(step, "/name"))]  # (it waits for the keys)
    except (RuntimeError, ValueError):
        names = None
    if names is not None and len(set(names)) > 1:
        made = ", ".join(f"rank {r}: {name}" for r, name in enumerate(names))
        _raise(RanksDisagree(f"{what}: the ranks made their compiled steps in different orders ({made})"))
    deadline = time.monotonic() + store.timeout.total_seconds()
    pause = _FIRST_PAUSE
    while names is not None:
        try:
            posted = [tuple(map(int, post.split())) for post in store.multi_get(_keys(step))]
        except (RuntimeError, ValueError):
            break
        running = [r for r, (made, program) in enumerate(posted) if made > call or (made == call and program)]
        if running or all(made >= call for made, _ in posted):
            return running
        if time.monotonic() > deadline:
            behind = [r for r, (made, _) in enumerate(posted) if made < call]
            _raise(RanksDisagree(f"{what}: rank(s) {behind} did not make call #{call} (waited {store.timeout})"))
        time.sleep(pause)
        pause = min(2 * pause, _LONGEST_PAUSE)
    _raise(RanksDisagree(f"{what}: some rank did not make the step, or call #{call} of it (waited {store.timeout})"))


def programs_run(step: int, call: int) -> dict[int, int]:
    """The program each rank posted for call #``call`` of ``step`` (0: traced), of the ranks whose latest post is for
    that call: after this rank's program ran, every rank it ran collectives with."""
    posted = [tuple(map(int, post.split())) for post in _store().multi_get(_keys(step))]
    return {r: program for r, (made, program) in enumerate(posted) if made == call}
