"""Stage transfers of CUDA pipelines: compute and transfers on separate CUDA streams, ordered by events.

Activations and gradients travel over the process group's CPU transport (gloo), so on CUDA they leave and enter
the device through pinned host memory, copied on one highest-priority copy stream per channel (a lane). A
leaving tensor's copy waits for a ticket marked on the compute stream right after the work that made it;
compute waits for an arriving tensor's copy on the device, not on the host. See docs/pipeline.md, "On CUDA".
"""

import threading
from collections import deque

import torch


class StreamScheduler:
    """Copy streams per lane at the device's highest priority, and pooled events named by integer tickets.

    ``mark(stream)`` records what is queued on ``stream`` so far under a new ticket; ``stage(lane, after,
    copies)`` queues ``copies`` (destination, source) on the lane's stream behind ticket ``after`` (-1: none)
    and returns the ticket of their completion; ``order(stream, ticket)`` makes ``stream`` wait for a ticket
    on the device; ``done`` / ``wait`` ask for or wait for a ticket on the host; ``release`` returns it to the
    pool. Every method may be called from any thread."""

    def __init__(self, device: int):
        self.device = torch.device("cuda", device)
        self._streams: list = []
        self._events: list = []
        self._free: list[int] = []
        self._held: set[int] = set()
        self._lock = threading.Lock()

    @property
    def outstanding(self) -> int:
        return len(self._held)

    def add_lane(self) -> int:
        highest = torch.cuda.Stream.priority_range()[1]  # numerically lowest is the highest priority
        with self._lock:
            self._streams.append(torch.cuda.Stream(self.device, priority=highest))
            return len(self._streams) - 1

    def lane_stream(self, lane: int) -> int:
        return self._streams[lane].cuda_stream

    def _acquire(self) -> int:
        with self._lock:
            if not self._free:
                self._events.append(torch.cuda.Event())
                self._free.append(len(self._events) - 1)
            ticket = self._free.pop()
            self._held.add(ticket)
            return ticket

    def _event(self, ticket: int):
        if ticket not in self._held:
            raise ValueError(f"sbp_torch stream scheduler: ticket {ticket} is not held")
        return self._events[ticket]

    def mark(self, stream) -> int:
        ticket = self._acquire()
        self._event(ticket).record(stream)
        return ticket

    def stage(self, lane: int, after: int, copies) -> int:
        if any(dst.nbytes != src.nbytes for dst, src in copies):
            raise ValueError("sbp_torch stream scheduler: a copy's destination and source differ in size")
        stream = self._streams[lane]
        if after >= 0:
            stream.wait_event(self._event(after))
        with torch.cuda.stream(stream):
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
        ticket = self._acquire()
        self._event(ticket).record(stream)
        return ticket

    def order(self, stream, ticket: int) -> None:
        stream.wait_event(self._event(ticket))

    def done(self, ticket: int) -> bool:
        return self._event(ticket).query()

    def wait(self, ticket: int) -> None:
        self._event(ticket).synchronize()

    def release(self, ticket: int) -> None:
        with self._lock:
            self._event(ticket)
            self._held.discard(ticket)
            self._free.append(ticket)


class Staging:
    """One pipeline's device side on this rank: the compute stream, a copy stream per channel, and the pinned
    buffers of arriving tensors, kept until their copies have run (also those of a failed step, which never
    reach compute)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.scheduler = StreamScheduler(device.index)
        self.compute = torch.cuda.current_stream(device)
        self._lanes: dict = {}  # channel -> (lane index, its copy stream as a torch stream)
        self._lock = threading.Lock()  # lanes stage, the actor loop hands over
        self._staged: dict = {}  # ticket -> pinned buffer: copies queued, not yet handed to compute
        self._arrived: deque = deque()  # (ticket, pinned buffer): handed to compute, not known to be done

    def begin_step(self) -> None:
        """Compute runs on the stream that is current when the step starts."""
        self.compute = torch.cuda.current_stream(self.device)

    def _lane(self, channel) -> tuple:
        if channel not in self._lanes:
            lane = self.scheduler.add_lane()
            stream = torch.cuda.ExternalStream(self.scheduler.lane_stream(lane), device=self.device)
            self._lanes[channel] = lane, stream
        return self._lanes[channel]

    def mark(self) -> int:
        """(Actor loop.) A ticket for the compute queued so far: what the tensors about to leave wait for."""
        return self.scheduler.mark(self.compute)

    def to_host(self, channel, tensors: list[torch.Tensor], after: int) -> list[torch.Tensor]:
        """(Lane thread.) Pinned host copies of contiguous device ``tensors``, made on the channel's copy stream
        after ticket ``after`` (which this releases); returns once they are there."""
        try:
            hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            ticket = self.scheduler.stage(self._lane(channel)[0], after, list(zip(hosts, tensors)))
            try:
                self.scheduler.wait(ticket)
            finally:
                self.scheduler.release(ticket)
            return hosts
        finally:
            self.scheduler.release(after)

    def to_device(self, channel, host: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(Lane thread.) A device copy of pinned ``host`` (kept alive until the copy has run), queued on the
        channel's copy stream; returns it and the ticket of its copy, which ``arrive`` hands to compute. Its
        memory is allocated on the copy stream: memory of the compute stream's pool may still be in use by
        compute queued there, which the copy stream does not wait for (a race seen on an H100). Compute, which
        uses and frees it later, is recorded on it, so the allocator waits for that use before reuse."""
        lane, stream = self._lane(channel)
        with torch.cuda.stream(stream):
            out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        out.record_stream(self.compute)
        ticket = self.scheduler.stage(lane, -1, [(out, host)])
        with self._lock:
            self._staged[ticket] = host
        return out, ticket

    def arrive(self, ticket: int) -> None:
        """(Actor loop.) Order compute after the copy of ``ticket``, without waiting."""
        self.scheduler.order(self.compute, ticket)
        with self._lock:
            self._arrived.append((ticket, self._staged.pop(ticket)))
        self.reap()

    def reap(self, wait: bool = False) -> None:
        """Let go of the pinned buffers whose copies have run (``wait``: of all, waiting for them, including
        copies staged but never handed to compute, as a failed step leaves them)."""
        if wait:
            with self._lock:
                left, self._staged = list(self._staged), {}
            for ticket in left:
                self.scheduler.wait(ticket)
                self.scheduler.release(ticket)
        while self._arrived:
            ticket, _ = self._arrived[0]
            if wait:
                self.scheduler.wait(ticket)
            elif not self.scheduler.done(ticket):
                return
            self.scheduler.release(ticket)
            self._arrived.popleft()
