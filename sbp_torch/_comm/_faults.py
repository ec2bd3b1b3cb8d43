"""A failure on one rank becomes an error on every rank, never a wait (docs/faults.md).

A collective pairs the n-th call of each rank of its group. An exception that escapes the local computation of a
global op on one rank leaves that rank out of step: its next collectives would meet the others' different calls.
So that rank posts what went wrong to the default group's store and closes its process groups: gloo closes their
connections, and a peer blocked in a collective with it fails at once ("Connection closed by peer"), reads the
posted failures and closes its own groups in turn, so the failure spreads along the groups to every rank. On
torch 2.13 gloo's ``abort()`` and ``shutdown()`` leave the connections open; only freeing the groups closes them.

Posts live under ``FAILED/<rank>``, and each posting rank appends its number to ``FAILED`` (an atomic append), so
a reader needs two round trips. Nothing touches the store unless something failed."""

import contextlib
import contextvars
import datetime
import inspect
import sys
import weakref

import torch
import torch.distributed as dist

from ._groups import forget_groups

FAILED = "sbp_torch/failed"
_READ_TIMEOUT = datetime.timedelta(seconds=2)  # the store's own server may be gone with a dead rank
_last_store: list = [None]
_CALLER_STOPS_ONE_RANK_FAILURES = contextvars.ContextVar("sbp_torch_caller_stops_failures", default=False)


# Started collectives not yet waited for (``_primitives._Started``): each holds a group and a work, and either
# keeps the group's connections open; closing the world releases them.
HELD: weakref.WeakSet = weakref.WeakSet()


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the collective, the placement axis and ranks, the
    tensor, and what other ranks posted when they failed."""


@contextlib.contextmanager
def caller_stops_one_rank_failures():
    """Within the block, a failure in an op on a one-rank placement is left to the caller, which brings every
    rank to a stop itself (the pipeline's step does); no peer can be waiting inside such an op."""
    token = _CALLER_STOPS_ONE_RANK_FAILURES.set(True)
    try:
        yield
    finally:
        _CALLER_STOPS_ONE_RANK_FAILURES.reset(token)


def ops_on_some_ranks() -> bool:
    """Whether the caller runs ops on some ranks only (a pipeline's step: each rank runs its own stages' ops)."""
    return _CALLER_STOPS_ONE_RANK_FAILURES.get()


def local_failure(what, err: Exception, ranks: int, alike: bool) -> None:
    """The local computation of the op ``what`` on a placement of ``ranks`` ranks (0: unknown) raised ``err`` on
    this rank: post it and close this rank's process groups, unless that was done, or the caller stops the ranks,
    or every rank of the world ran it on the same values (``alike``) and so raises the same error."""
    if isinstance(err, CollectiveError) or not dist.is_initialized():
        return
    if ranks == 1 and _CALLER_STOPS_ONE_RANK_FAILURES.get():
        return
    if alike and ranks == dist.get_world_size() and not isinstance(err, torch.OutOfMemoryError):
        return
    close_world(f"{type(err).__name__} in {what}: {err}", err)


def close_world(failure: str | None, err: BaseException) -> None:
    """Post ``failure`` (if any) as this rank's, then destroy every process group and drop our references, so that
    gloo closes the connections; note on ``err`` that this rank's world is closed."""
    rank = dist.get_rank()
    _store()  # kept, to read what others post
    if failure is not None:
        _post(rank, failure)
    forget_groups()
    for started in list(HELD):
        started.release()
    _unbind_world_defaults()
    try:
        dist.destroy_process_group()  # the wrapper of _groups.py collects garbage first
    except (RuntimeError, ValueError) as closing:  # ``err`` is what the user must see
        err.add_note(f"sbp_torch: closing the process groups of rank {rank} failed: {closing}")
    err.add_note(
        f"sbp_torch: rank {rank} closed its process groups so that the other ranks raise instead of waiting "
        "(docs/faults.md); restart the job, from a checkpoint"
    )


def _unbind_world_defaults() -> None:
    """``torch.distributed.nn.functional``, imported after ``init_process_group`` (the distributed checkpoint
    imports it), holds the default group in its functions' defaults: that alone would keep the world's connections
    open. To those functions None means the same group."""
    module = sys.modules.get("torch.distributed.nn.functional")
    for fn in vars(module).values() if module is not None else ():
        if inspect.isfunction(fn) and fn.__defaults__:
            fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in fn.__defaults__)


def _store():
    """The default group's store; once this rank closed its groups, the store they had."""
    if dist.is_initialized():
        _last_store[0] = dist.distributed_c10d._get_default_store()
    return _last_store[0]


def _post(rank: int, failure: str) -> None:
    store = _store()
    try:
        store.set(f"{FAILED}/{rank}", f"rank {rank} raised {failure}"[:4000])
        store.append(FAILED, f"{rank} ")
    except (RuntimeError, ValueError):  # the store is gone too: the peers will still see the connections close
        pass


def posted_failures() -> list[str]:
    """What the ranks that failed posted (empty if none, or if the store cannot be reached)."""
    store = _store()
    if store is None:
        return []
    timeout = store.timeout
    store.set_timeout(_READ_TIMEOUT)
    try:
        if not store.check([FAILED]):
            return []
        ranks = store.get(FAILED).decode().split()
        return [text.decode() for text in store.multi_get([f"{FAILED}/{r}" for r in ranks])]
    except (RuntimeError, ValueError):
        return []
    finally:
        store.set_timeout(timeout)


def collective_failed(message: str, err: BaseException) -> CollectiveError:
    """The error to raise when a collective described by ``message`` failed with ``err``: with the failures other
    ranks posted; if there are any, this rank's world is closed too, so that the failure reaches its peers."""
    posted = posted_failures()
    if posted:
        err = f"{err}\nposted by the ranks that failed:\n  " + "\n  ".join(posted)
    error = CollectiveError(f"{message}: {err}")
    if posted and dist.is_initialized():
        close_world(None, error)
    return error
