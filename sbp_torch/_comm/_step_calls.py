"""At each call of a compiled step, each rank says whether it traces a new program or runs one it holds.

A rank tracing where the others run their programs (what a program is traced for changed on it alone: eval mode, a
hyperparameter, ``reset()``) would wait for their trace while they wait in their collectives for it, until a
timeout. So each call posts one line to the default store (a write that waits for no one, under one key per step
and rank), and a rank about to trace reads the others' lines for that call first: where one runs a program, it
raises at once and closes its process groups, so that the others' collectives fail at once too (``_faults.py``)."""

import time

import torch.distributed as dist

from ._compiled import RanksDisagree
from ._faults import close_world

_PREFIX = "sbp_torch/step_calls"
_FIRST_PAUSE, _LONGEST_PAUSE = 0.001, 0.05  # seconds between reads while some rank has not reached the call


def announce_call(step: int, call: int, traces: bool) -> None:
    """Post that this rank makes call #``call`` (counted alike on every rank) of the compiled step ``step`` (its
    number, alike on every rank) by tracing a program (``traces``) or by running one it holds."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{_PREFIX}/{step}/{dist.get_rank()}", f"{call} {int(traces)}")


def ranks_running(step: int, call: int, what: str) -> list[int]:
    """The ranks that run a program they hold at call #``call`` of ``step`` (or went past it: a program with no
    collective), where this rank traces one; waits until every rank has announced the call. A rank that does not
    within the store's timeout makes this rank raise ``RanksDisagree`` (``what`` names the step), its world
    closed."""
    store = dist.distributed_c10d._get_default_store()
    keys = [f"{_PREFIX}/{step}/{rank}" for rank in range(dist.get_world_size())]
    deadline = time.monotonic() + store.timeout.total_seconds()
    pause = _FIRST_PAUSE
    while True:
        try:
            lines = [value.decode().split() for value in store.multi_get(keys)]  # (it waits for the keys)
        except (RuntimeError, ValueError):
            lines = None
        if lines is not None:
            posted = [(int(made), traces == "1") for made, traces in lines]
            running = [r for r, (made, traces) in enumerate(posted) if made > call or (made == call and not traces)]
            if running or all(made >= call for made, _ in posted):
                return running
        if lines is None or time.monotonic() > deadline:
            behind = "some" if lines is None else [r for r, (made, _) in enumerate(posted) if made < call]
            error = RanksDisagree(
                f"{what}: rank(s) {behind} did not make call #{call} of the step within the store's timeout "
                f"({store.timeout}), where this rank traces a program: every rank must call the step as often"
            )
            close_world(f"RanksDisagree: {error}", error)
            raise error
        time.sleep(pause)
        pause = min(2 * pause, _LONGEST_PAUSE)
