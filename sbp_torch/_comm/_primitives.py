"""One collective call on one axis group, in the form that fits how the program runs.

Run eagerly, a collective is ``torch.distributed``'s call that writes into a buffer and is waited for here; a
failure or timeout raises ``CollectiveError`` naming the collective and the ranks. Traced by ``torch.compile``
(``_compiled.compiling``: Dynamo's and AOTAutograd's runs), it is the functional op
of ``torch.ops._c10d_functional`` that returns a new tensor, followed by its ``wait_tensor``: a graph can hold
that pair, Inductor lowers it and may move the wait later, whereas an in-place ``c10d`` call traced into a graph
loses its wait and its result is read before it arrives. Each traced collective is recorded for the check that
the ranks' compiled programs agree (``_compiled.py``). The inputs are already on the wire (``_collectives``
picks dtypes every backend carries) and contiguous."""

import torch
import torch.distributed as dist

from .._layout import Broadcast
from . import _faults
from ._compiled import compiling, record
from ._faults import CollectiveError
from ._groups import AxisGroup
from ._observer import estimating, notify

_functional = torch.ops._c10d_functional
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

# torch 2.13 renamed all_gather_into_tensor; keep working on 2.11.
_all_gather_even = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_even = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def traced() -> bool:
    """Whether a collective must be a functional op: torch.compile traces the running code, or a step is estimated."""
    return compiling() or estimating()


def _issue(kind: str, group: AxisGroup, tensor: torch.Tensor, sends=None, receives=None) -> bool:
    """Tell the observer of the collective ``kind`` on ``tensor`` (an all-to-all: ``sends`` elements to each group
    rank, ``receives`` from each); return whether it must be a functional op, which is then recorded."""
    notify(kind, group, lambda: tensor.nbytes)
    if traced():
        record(kind, group, tensor, sends, receives)
        return True
    return False


def run(what: str, group: AxisGroup, tensor: torch.Tensor, call):
    """``call()``, with a failure of the collective ``what`` reported as a ``CollectiveError``."""
    try:
        return call()
    except RuntimeError as err:  # gloo reports timeouts and peer failures as RuntimeError
        raise _faults.collective_failed(
            f"{what} {group.describe()}, this rank is index {group.index}, for a {tuple(tensor.shape)} "
            f"{tensor.dtype} tensor, failed while waiting for the other ranks",
            err,
        ) from err


def local_failure(what, err: Exception, placement=None, inputs=None) -> None:
    """The local computation of ``what`` on ``placement`` (None: unknown) raised ``err`` on this rank (see
    ``_faults.local_failure``); ``inputs``: the metas of its inputs if the op ran on them as laid out (None: it
    ran otherwise, or unknown). Nothing to do while traced: the tracer may catch it, and nothing ran."""
    if not traced():
        ranks = 0 if placement is None else len(placement.flat_ranks)
        alike = inputs is not None and all(isinstance(s, Broadcast) for meta in inputs for s in meta.sbp)
        _faults.local_failure(what, err, ranks, alike)


def _name(group: AxisGroup) -> str:
    return group.process_group.group_name


def broadcast(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Axis coordinate 0's ``x`` on every rank of the group, as a new tensor."""
    src = group.ranks[0]
    if _issue("broadcast", group, x):
        root = dist.get_group_rank(group.process_group, src)
        return _functional.wait_tensor(_functional.broadcast(x, root, _name(group)))
    out = x.clone()
    run("broadcast", group, x, lambda: dist.broadcast(out, src, group.process_group))
    return out


def all_gather(rows: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Every rank's equal ``rows`` end to end along dim 0, in torch's group order."""
    return start_all_gather(rows, group)()


def reduce_scatter(send: torch.Tensor, op: str, group: AxisGroup) -> torch.Tensor:
    """Reduce ``send`` over the group with ``op``; this rank keeps its equal slice of dim 0 (group order)."""
    return start_reduce_scatter(send, op, group)()


def all_to_all(send: torch.Tensor, out_counts: list[int], in_counts: list[int], what: str, group: AxisGroup):
    """Send ``in_counts[g]`` elements of the flat ``send`` to group rank g, in order; receive ``out_counts[g]``
    from each, end to end in one flat tensor."""
    if _issue(what, group, send, in_counts, out_counts):
        return _functional.wait_tensor(_functional.all_to_all_single(send, out_counts, in_counts, _name(group)))
    out = send.new_empty(sum(out_counts))
    run(what, group, send, lambda: dist.all_to_all_single(out, send, out_counts, in_counts, group.process_group))
    return out


def start_all_reduce(x: torch.Tensor, op: str, group: AxisGroup):
    """Begin the element-wise ``op`` of ``x`` over the group; returns ``finish()``, which waits and returns the
    result as a new tensor."""
    what = f"all-reduce({op})"
    if _issue(what, group, x):
        started = _functional.all_reduce(x, op, _name(group))
        return lambda: _functional.wait_tensor(started)
    out = x.clone()
    work = run(what, group, x, lambda: dist.all_reduce(out, _REDUCE_OPS[op], group.process_group, async_op=True))
    return _finisher(_Started(what, group, x, work), out)


def start_all_gather(rows: torch.Tensor, group: AxisGroup):
    """Begin ``all_gather(rows, group)`` without waiting; returns ``finish()``, which waits and returns it."""
    if _issue("all-gather", group, rows):
        started = _functional.all_gather_into_tensor(rows, group.size, _name(group))
        return lambda: _functional.wait_tensor(started)
    out = rows.new_empty((rows.shape[0] * group.size, *rows.shape[1:]))
    work = run("all-gather", group, rows, lambda: _all_gather_even(out, rows, group.process_group, async_op=True))
    return _finisher(_Started("all-gather", group, rows, work), out)


def start_reduce_scatter(send: torch.Tensor, op: str, group: AxisGroup):
    """Begin ``reduce_scatter(send, op, group)`` without waiting; returns ``finish()``, which waits and returns it."""
    what = f"reduce-scatter({op})"
    if _issue(what, group, send):
        started = _functional.reduce_scatter_tensor(send, op, group.size, _name(group))
        return lambda: _functional.wait_tensor(started)
    out = send.new_empty((send.shape[0] // group.size, *send.shape[1:]))
    work = run(what, group, send, lambda: _reduce_scatter_even(out, send, _REDUCE_OPS[op], group.process_group,
                                                              async_op=True))  # fmt: skip
    return _finisher(_Started(what, group, send, work), out)


def _finisher(started, out: torch.Tensor):
    def finish() -> torch.Tensor:  # holds no group: a group held keeps its connections open after a failure
        started.wait()
        return out

    return finish


class _Started:
    """A started collective until it is waited for; ``_faults.close_world`` releases what it holds."""

    __slots__ = ("what", "group", "tensor", "work", "__weakref__")

    def __init__(self, what: str, group: AxisGroup, tensor: torch.Tensor, work):
        self.what, self.group, self.tensor, self.work = what, group, tensor, work
        _faults.HELD.add(self)

    def release(self) -> None:
        self.group = self.work = None

    def wait(self) -> None:
        group, work = self.group, self.work
        self.release()
        if work is None:
            raise CollectiveError(f"{self.what}: this rank closed its process groups after a failure")
        run(self.what, group, self.tensor, work.wait)
