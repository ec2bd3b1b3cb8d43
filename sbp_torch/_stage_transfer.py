"""Moving a global tensor from one stage's placement to another's, asynchronously, for the pipeline's transfer
actors.

The sender does not block: ``send`` posts the pieces with ``dist.isend`` and returns a poll that reports when
they are gone. The receiver does not know the tensor's shape or SBP in advance (micro-batches may differ in
size, a stage may return a split or partial activation), so the first rank of the source placement sends a
small header (pickled shape, dtype and SBP) to every destination rank first; ``recv`` posts the header's
receive, then the pieces' receives, and builds the destination part from them. The pieces are those of the
cross-placement plan (``_boxing.cross_placement``), so each destination rank receives only the box it needs.
A partial source is reduced inside its stage (``to_global`` on the source placement, run by the caller, which
every rank of the stage reaches in the same order) before it is sent, so pieces never overlap.
"""

from __future__ import annotations

import functools
import pickle
import threading

import torch
import torch.distributed as dist

from ._boxing.cross_placement import plan_cross
from ._boxing.pieces import box_of, cut
from ._global_tensor import GlobalTensor
from ._layout import GlobalMeta
from ._sbp import Broadcast, Partial

BROADCAST = Broadcast()

HEADER_BYTES = 1024


def without_partial(sbp: tuple) -> tuple:
    """``sbp`` with each partial axis made broadcast: what a stage sends."""
    return tuple(BROADCAST if isinstance(s, Partial) else s for s in sbp)


def _header(meta: GlobalMeta) -> torch.Tensor:
    data = pickle.dumps((meta.shape, str(meta.dtype), meta.sbp))
    if len(data) > HEADER_BYTES - 4:
        raise ValueError(f"tensor metadata too long to send between stages: {meta}")
    out = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    out[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
    out[4 : 4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def _parse_header(buf: torch.Tensor):
    n = int.from_bytes(bytes(buf[:4].tolist()), "little")
    shape, dtype, sbp = pickle.loads(bytes(buf[4 : 4 + n].tolist()))
    return tuple(shape), getattr(torch, dtype.removeprefix("torch.")), sbp


@functools.lru_cache(maxsize=256)
def _plan(src: GlobalMeta, dst: GlobalMeta):
    """The cross-placement plan, cached: a pipeline moves the same few layouts every micro-batch."""
    return plan_cross(src, dst)


class Waiters:
    """The threads that wait for one step's point-to-point work. gloo's point-to-point work reports completion
    only through ``wait()``, which releases the GIL, so a waiting thread per transfer lets the actor loop go
    on with compute meanwhile. The step joins them when it ends, so that none outlives it: a daemon thread
    still returning into Python while the interpreter shuts down aborts the process."""

    def __init__(self, notify):
        self.notify = notify
        self.threads: list[threading.Thread] = []

    def start(self, fn):
        """Run ``fn`` on a thread; returns a poll: None until it ended, then its result (re-raising its error)."""
        box = {}

        def target():
            try:
                box["value"] = fn()
            except BaseException as err:  # noqa: BLE001 - handed to the loop
                box["error"] = err
            box["done"] = True
            self.notify()

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        self.threads.append(thread)

        def poll():
            if "done" not in box:
                return None
            if "error" in box:
                raise box["error"]
            return box["value"]

        return poll

    def join(self) -> None:
        """Wait for every thread to end (each has reported its work done)."""
        for thread in self.threads:
            thread.join()
        self.threads.clear()


def send(x: GlobalTensor, dst_placement, tag: int, waiters: Waiters):
    """Post this rank's pieces of ``x`` (no partial axes) towards ``dst_placement``; returns a poll:
    ``() -> True`` once every send completed (``waiters.notify()`` is called then). ``tag`` .. ``tag + pieces``
    are used."""
    me, meta = dist.get_rank(), x._meta
    works = []
    if me == meta.placement.flat_ranks[0]:
        header = _header(meta)
        works += [dist.isend(header, r, tag=tag) for r in dst_placement.flat_ranks]
    dst = GlobalMeta(meta.shape, meta.dtype, dst_placement, _receiver_sbp(meta.sbp, dst_placement))
    plan = _plan(meta, dst)
    coord = meta.placement.coord_of(me)
    origin = box_of(meta, coord)[0]
    for i, piece in enumerate(plan.pieces):
        if piece.src == me:
            works.append(dist.isend(cut(x._local, origin, piece).contiguous(), piece.dst, tag=tag + 1 + i))
    def wait_all():
        for work in works:
            work.wait()
        return True

    return waiters.start(wait_all)


def _receiver_sbp(src_sbp: tuple, dst_placement) -> tuple:
    """The layout a stage receives: the sender's SBP where it fits the destination's axes, else broadcast."""
    if len(src_sbp) == dst_placement.ndim:
        return without_partial(src_sbp)
    return (BROADCAST,) * dst_placement.ndim


def recv(src_placement, dst_placement, tag: int, requires_grad: bool, waiters: Waiters):
    """Post the receives of a tensor sent by ``send`` from ``src_placement``; returns a poll:
    ``() -> GlobalTensor`` on ``dst_placement`` (a leaf) once it has arrived, None before."""
    me = dist.get_rank()
    header = torch.empty(HEADER_BYTES, dtype=torch.uint8)
    header_work = dist.irecv(header, src_placement.flat_ranks[0], tag=tag)

    def receive():
        header_work.wait()
        shape, dtype, sbp = _parse_header(header)
        src = GlobalMeta(shape, dtype, src_placement, sbp)
        dst = GlobalMeta(shape, dtype, dst_placement, _receiver_sbp(sbp, dst_placement))
        coord = dst_placement.coord_of(me)
        out = torch.empty(dst.local_shape(coord), dtype=dtype)
        origin = box_of(dst, coord)[0]
        for i, piece in enumerate(_plan(src, dst).pieces):
            if piece.dst == me:
                # received straight into the destination part when the piece is a contiguous view of it
                view = cut(out, origin, piece)
                buf = view if view.is_contiguous() else torch.empty(piece.lengths, dtype=dtype)
                dist.irecv(buf, piece.src, tag=tag + 1 + i).wait()
                if buf is not view:
                    view.copy_(buf)
        return out, dst

    done = waiters.start(receive)

    def poll():
        result = done()
        return None if result is None else GlobalTensor(result[0], result[1], requires_grad=requires_grad)

    return poll
