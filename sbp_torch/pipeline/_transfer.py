"""Moving a global tensor from one stage's placement to another's, asynchronously, for the pipeline's transfer
actors (docs/pipeline.md, "Transfers").

``send`` and ``recv`` return polls; their work runs on the channel's lane (``Lanes``). Each destination rank
receives only its box of the cross-placement plan (``_boxing.cross_placement``); a partial source is reduced
inside its stage by the caller before it is sent, so pieces never overlap. The receiver does not know the
tensor's layout in advance, so the first source rank sends a header (shape, dtype, SBP). So that the data need
not wait for it, the receiver posts at once the receives of the layout it guesses: the channel's last
(``Channel``), which the sender knows too. A wrong guess is answered with zeros, then the real pieces follow
under the next tags. On CUDA the pieces pass through pinned host memory (``_cuda_staging.Staging``).
"""

import functools
import pickle
import queue
import threading

import torch
import torch.distributed as dist

from .._boxing import box_of, cut, plan_cross
from .._layout import GlobalMeta, broadcast, partials_as_broadcast
from .._tensor import GlobalTensor

HEADER_BYTES = 1024
TAGS_PER_TRANSFER = 1 << 10  # the header, the guessed pieces and the real pieces of one tensor


@functools.lru_cache(maxsize=256)
def _header(meta: GlobalMeta) -> torch.Tensor:
    """The header of a tensor of ``meta`` (cached: a pipeline sends the same few layouts every micro-batch;
    the sender never writes into it)."""
    data = pickle.dumps((meta.shape, str(meta.dtype), meta.sbp))
    if len(data) > HEADER_BYTES - 4:
        raise ValueError(f"tensor metadata too long to send between stages: {meta}")
    return torch.frombuffer(
        bytearray(len(data).to_bytes(4, "little") + data.ljust(HEADER_BYTES - 4, b"\0")), dtype=torch.uint8
    )


def _parse_header(buf: torch.Tensor):
    raw = buf.numpy().tobytes()
    return _parse_header_bytes(raw[4 : 4 + int.from_bytes(raw[:4], "little")])


@functools.lru_cache(maxsize=256)
def _parse_header_bytes(data: bytes):
    shape, dtype, sbp = pickle.loads(data)
    return tuple(shape), getattr(torch, dtype.removeprefix("torch.")), sbp


@functools.lru_cache(maxsize=256)
def _plan(src: GlobalMeta, dst: GlobalMeta):
    """The cross-placement plan, cached: a pipeline moves the same few layouts every micro-batch."""
    return plan_cross(src, dst)


class Cancelled(Exception):
    """The step failed: a lane leaves its transfer, whose posted work ``Lanes.drain`` answered."""


class Lanes:
    """The threads that run a pipeline's transfers, and a record of the point-to-point work each step posted.

    gloo's point-to-point work reports completion only through ``wait()``, which releases the GIL, so each channel
    has a *lane*: a thread that runs the channel's transfers one after the other (its actor fires again only when the
    last is done) while the actor loop goes on with compute. Lanes live as long as their pipeline (``close`` ends
    them): starting a thread per transfer sat on every hand-over's critical path. Every send and receive goes through
    ``isend`` / ``irecv``, which record it, so that after a failed step ``drain`` can answer each one whose peer
    never posted the other half. ``staging`` (a ``_cuda_staging.Staging``, for CUDA stages) moves pieces between the
    device and the pinned host memory that the wire carries."""

    def __init__(self, staging=None):
        self.staging = staging
        self.lanes: dict = {}  # channel -> (thread, its queue of (fn, box))
        self._lock = threading.Lock()
        self._notify = None
        self._posted: list[tuple] = []  # (kind, src, dst, tag, numel, dtype) of every isend / irecv this step
        self._cancelled = False

    def begin_step(self, notify) -> None:
        """Start a step whose actor loop ``notify()`` wakes when a transfer ends."""
        self._notify, self._posted, self._cancelled = notify, [], False
        if self.staging is not None:
            self.staging.begin_step()

    def start(self, channel, fn):
        """Run ``fn(posted)`` on ``channel``'s lane; returns a poll: None until it ended, then its result
        (re-raising its error). ``fn`` posts its sends and receives into the list ``posted`` (``isend``,
        ``irecv``) and waits for them with ``wait``."""
        if channel not in self.lanes:
            work = queue.SimpleQueue()
            thread = threading.Thread(target=self._lane, args=(work,), daemon=True)
            thread.start()
            self.lanes[channel] = (thread, work)
        box: dict = {}
        self.lanes[channel][1].put((fn, box))

        def poll():
            if "done" not in box:
                return None
            if "error" in box:
                raise box["error"]
            return box["value"]

        return poll

    def _lane(self, work: queue.SimpleQueue) -> None:
        while (item := work.get()) is not None:
            fn, box = item
            posted: list = []
            try:
                box["value"] = fn(posted)
            except BaseException as err:  # noqa: BLE001 - handed to the loop
                box["error"] = err
            finally:
                # A transfer that failed may leave sends and receives posted and not waited for. Each must
                # complete before it is let go (``drain`` answers what lacks its other half): gloo holds on to
                # its buffer, and a message for a freed buffer stops everything after it on that peer's link.
                for posted_work in posted:
                    posted_work.wait()
            box["done"] = True
            self._notify()

    def isend(self, tensor: torch.Tensor, dst: int, tag: int, posted: list) -> None:
        self._record("send", dist.get_rank(), dst, tag, tensor)
        posted.append(dist.isend(tensor, dst, tag=tag))

    def irecv(self, buf: torch.Tensor, src: int, tag: int, posted: list) -> None:
        self._record("recv", src, dist.get_rank(), tag, buf)
        posted.append(dist.irecv(buf, src, tag=tag))

    def _record(self, kind: str, src: int, dst: int, tag: int, tensor: torch.Tensor) -> None:
        with self._lock:  # a post after ``drain`` took its snapshot would never be answered
            if self._cancelled:
                raise Cancelled
            self._posted.append((kind, src, dst, tag, tensor.numel(), tensor.dtype))

    def wait(self, posted: list) -> None:
        """Wait for every send and receive in ``posted`` (each exactly once: waiting twice would wait for a
        second completion) and empty it; raises ``Cancelled`` if the step failed meanwhile (the receives may
        hold the zeros that ``drain`` sent)."""
        while posted:
            posted.pop(0).wait()
        if self._cancelled:
            raise Cancelled

    def settle(self) -> None:
        """Wait until every lane has finished the work handed to it (and, on CUDA, its copies have run)."""
        marks = []
        for _, work in self.lanes.values():
            done = threading.Event()
            work.put((lambda posted, done=done: done.set(), {}))
            marks.append(done)
        for done in marks:
            done.wait()
        if self.staging is not None:
            self.staging.reap(wait=True)

    def close(self, timeout: float = 5.0) -> None:
        """End every lane after the work handed to it. A lane still waiting after ``timeout`` seconds (a step
        interrupted by something other than an exception in a stage, which ``drain`` would have answered) is
        left behind rather than hang the process at exit."""
        for _, work in self.lanes.values():
            work.put(None)
        for thread, _ in self.lanes.values():
            thread.join(timeout)
        self.lanes.clear()

    def drain(self) -> None:
        """After a failed step, on every rank (a collective of the default group): answer every send or receive
        whose peer never posted the other half (a receive gets zeros, a send is received into scratch space),
        so that every lane's wait returns, then let the lanes settle. Tags are unique within a step, so a
        posted half and its record on the peer's side identify each other."""
        with self._lock:
            self._cancelled = True
            mine = list(self._posted)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        posted = {record[:4] for records in everyone for record in records}
        me, answers = dist.get_rank(), []
        for records in everyone:
            for kind, src, dst, tag, numel, dtype in records:
                if kind == "recv" and src == me and ("send", src, dst, tag) not in posted:
                    answers.append(dist.isend(torch.zeros(numel, dtype=dtype), dst, tag=tag))
                elif kind == "send" and dst == me and ("recv", src, dst, tag) not in posted:
                    answers.append(dist.irecv(torch.empty(numel, dtype=dtype), src, tag=tag))
        for work in answers:
            work.wait()
        self.settle()


class Channel:
    """One direction of one stage boundary, as seen by one rank: the source layout of its last tensor. Sender
    and receivers see the same sequence of layouts (an actor fires again only when its last transfer is done),
    so both know what the receivers will guess for the next one."""

    def __init__(self):
        self.last: GlobalMeta | None = None


def _destination(src: GlobalMeta, dst_placement) -> GlobalMeta:
    """The layout a stage receives: the sender's SBP where it fits the destination's axes, else broadcast."""
    sbp = partials_as_broadcast(src.sbp) if len(src.sbp) == dst_placement.ndim else (broadcast,) * dst_placement.ndim
    return GlobalMeta(src.shape, src.dtype, dst_placement, sbp)


def send(x: GlobalTensor, dst_placement, tag: int, lanes: Lanes, channel: Channel):
    """Post this rank's pieces of ``x`` (no partial axes) towards ``dst_placement``; returns a poll: ``() -> True``
    once every send completed (the step's ``notify`` is called then). Tags from ``tag`` on: the header, then the
    pieces of the layout the receivers guessed (the channel's last), then, if the guess is wrong, the real pieces
    after those. A wrong guess is answered with zeros of the guessed sizes, so no posted receive is left waiting."""
    me, meta = dist.get_rank(), x._meta
    guess, channel.last = channel.last, meta
    first = tag + 1
    outgoing = []  # (tensor, to rank, tag)
    if me == meta.placement.flat_ranks[0]:
        header = _header(meta)
        outgoing += [(header, r, tag) for r in dst_placement.flat_ranks]
    if guess is not None and guess != meta:
        guessed = _plan(guess, _destination(guess, dst_placement)).pieces
        outgoing += [
            (torch.zeros(p.lengths, dtype=guess.dtype), p.dst, first + i) for i, p in enumerate(guessed) if p.src == me
        ]
        first += len(guessed)
    plan = _plan(meta, _destination(meta, dst_placement))
    if first + len(plan.pieces) > tag + TAGS_PER_TRANSFER:
        raise ValueError(f"a tensor of {meta} travels in too many pieces ({len(plan.pieces)}) between stages")
    origin = box_of(meta, meta.placement.local_coord())[0]
    data = [(cut(x._local, origin, p), p.dst, first + i) for i, p in enumerate(plan.pieces) if p.src == me]
    staging = lanes.staging if x._local.is_cuda else None
    if staging is not None:  # contiguous on the compute stream, then a ticket their copies wait for
        data = [(t.contiguous(), r, t_) for t, r, t_ in data]
        after = staging.mark()

    def post_and_wait(posted):
        pieces = data
        if staging is not None:  # first: it releases the ticket whatever happens next
            hosts = staging.to_host(channel, [t for t, _, _ in data], after)
            pieces = [(h, r, t_) for h, (_, r, t_) in zip(hosts, data)]
        # posted here, not by the actor loop: gloo writes what the socket takes at once in the posting thread
        for t, r, t_ in outgoing + pieces:
            lanes.isend(t.contiguous(), r, t_, posted)
        lanes.wait(posted)
        return True

    return lanes.start(channel, post_and_wait)


def _post_receives(src: GlobalMeta, dst_placement, first_tag: int, lanes: Lanes, posted: list):
    """Post this rank's receives of the pieces of a tensor of ``src``, under tags from ``first_tag`` on, into
    ``posted``; returns (finish, the number of pieces of the plan), where ``finish()``, once they are waited
    for, returns (this rank's part, its metadata). Pieces that are contiguous views of the part are received
    in place."""
    me = dist.get_rank()
    dst = _destination(src, dst_placement)
    pieces = _plan(src, dst).pieces
    coord = dst_placement.coord_of(me)
    out = torch.empty(dst.local_shape(coord), dtype=src.dtype, pin_memory=lanes.staging is not None)
    origin = box_of(dst, coord)[0]
    copies = []
    for i, piece in enumerate(pieces):
        if piece.dst == me:
            view = cut(out, origin, piece)
            buf = view if view.is_contiguous() else torch.empty(piece.lengths, dtype=src.dtype)
            lanes.irecv(buf, piece.src, first_tag + i, posted)
            if buf is not view:
                copies.append((buf, view))

    def finish():
        for buf, view in copies:
            view.copy_(buf)
        return out, dst

    return finish, len(pieces)


def recv(src_placement, dst_placement, tag: int, requires_grad: bool, lanes: Lanes, channel: Channel):
    """Post the receives of a tensor sent by ``send`` from ``src_placement``; returns a poll:
    ``() -> GlobalTensor`` on ``dst_placement`` (a leaf) once it has arrived, None before. The header and the
    guessed pieces are posted at once, and waited for, on the channel's lane (see the module docstring)."""

    def receive(posted):
        header = torch.empty(HEADER_BYTES, dtype=torch.uint8)
        lanes.irecv(header, src_placement.flat_ranks[0], tag, posted)
        guess = channel.last
        guessed = _post_receives(guess, dst_placement, tag + 1, lanes, posted) if guess is not None else None
        lanes.wait(posted)  # the header, and the guessed pieces (zeros where the guess was wrong)
        shape, dtype, sbp = _parse_header(header)
        src = GlobalMeta(shape, dtype, src_placement, sbp)
        channel.last = src
        first = tag + 1
        if guessed is not None:
            finish, count = guessed
            if src == guess:
                return finish()
            first += count
        finish, _ = _post_receives(src, dst_placement, first, lanes, posted)
        lanes.wait(posted)
        return finish()

    def receive_to_device(posted):
        host, meta = receive(posted)
        return (meta,) + lanes.staging.to_device(channel, host)

    staged = lanes.staging is not None
    done = lanes.start(channel, receive_to_device if staged else receive)

    def poll():
        result = done()
        if result is None:
            return None
        if staged:
            meta, part, ticket = result
            lanes.staging.arrive(ticket)  # compute waits for the copy on the device, not here
        else:
            part, meta = result
        return GlobalTensor(part, meta, requires_grad=requires_grad)

    return poll
