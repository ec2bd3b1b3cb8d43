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
different orders raise at their first trace rather than wait for posts under the wrong step. A step whose program
was laid out on what the ranks agreed of their parts also exchanges every rank's own arguments at each call
(``step_arguments``), so that all trace when one rank's change."""

import time
from collections.abc import Callable

import torch.distributed as dist

from ._compiled import RanksDisagree, gather_call_facts
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


def step_arguments(name: str, mine: tuple) -> tuple:
    """Every rank's ``mine`` (the arguments of its call of the step ``name`` that may differ between ranks), in rank
    order; ``RanksDisagree`` on every rank where the ranks called different steps at once."""
    gathered = gather_call_facts("a compile_step call", (name, mine))
    if len({called for called, _ in gathered}) > 1:
        steps = ", ".join(f"rank {r}: {called}" for r, (called, _) in enumerate(gathered))
        raise RanksDisagree(f"compile_step: the ranks called different steps at once ({steps})")
    return tuple(theirs for _, theirs in gathered)


def refuse_a_lone_trace(step: int, call: int, name: str, changed: Callable[[], str]) -> None:
    """Raise on this rank, its world closed, where it would trace a program of ``step`` (``name``) at call #``call``
    while other ranks run one they hold: each would wait for the other until a timeout. ``changed()`` says what
    changed on this rank, in words."""
    running = ranks_running(step, call, f"compile_step, {name}")
    if running:
        _raise(
            RanksDisagree(
                f"compile_step, {name}: this rank traces a new program at call #{call} while rank(s) {running} run "
                f"one they traced before. On this rank {changed()}. What a program is traced for must change on "
                "every rank alike (docs/compile.md)"
            )
        )


def refuse_other_programs(step: int, call: int, name: str, mine: int, how: Callable[[int], str]) -> None:
    """Raise on this rank, its world closed, where the ranks it ran call #``call`` of ``step`` with ran other programs
    than its own number ``mine`` (their collectives paired with others: wrong values, or a wait); ``how(number)``
    says how their program differs. Asked by a rank that switched to another held program (ranks tracing at a call
    trace together): a rank that switches alone finds the others on their old program, and closing its world makes
    them raise at their next collective with it, so the ranks that did not switch need not ask, and a step that
    runs one program after another asks nothing."""
    others = {r: n for r, n in programs_run(step, call).items() if n != mine}
    if not others:
        return
    number = next(iter(others.values()))
    differs = "traced a new program there" if number == 0 else how(number)
    _raise(
        RanksDisagree(
            f"compile_step, {name}: at call #{call} rank(s) {sorted(others)} ran another program than this rank's "
            f"(#{number} there, #{mine} here): {differs}. What a program is traced for must change on every rank "
            "alike (docs/compile.md)"
        )
    )
