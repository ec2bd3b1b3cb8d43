"""The actor runtime: registers with slot quotas, actors that fire when readable and free, one loop per rank.

It knows nothing of tensors, placements or torch.distributed; docs/pipeline.md ("The actor model") describes it.
``Runtime.run()`` is the loop of one rank: it completes finished asynchronous work, then fires the first ready
actor in the order they were added (that order is the priority), until every actor has fired its count. There
is no coordinator: actors on other ranks are reached only through the messages that transfer actors exchange.
"""

import threading
import time
from collections import deque
from dataclasses import dataclass, field


class Register:
    """An actor's output: a FIFO of up to ``slots`` entries that its one consumer takes in order and releases.
    With ``read_when_full`` it is readable only when full or when its producer has finished: that is how a
    stage's backward yields to its forward until the forward may not run ahead any further."""

    def __init__(self, name: str, slots: int, *, read_when_full: bool = False):
        if slots < 1:
            raise ValueError(f"register {name} needs at least one slot, got {slots}")
        self.name, self.slots, self.read_when_full = name, slots, read_when_full
        self.entries: deque = deque()  # produced, not yet taken
        self.occupied = 0  # produced, not yet released
        self.peak = 0  # most slots occupied at once
        self.producer_done = False

    def free(self) -> bool:
        return self.occupied < self.slots

    def readable(self) -> bool:
        if not self.entries:
            return False
        return not self.read_when_full or self.occupied == self.slots or self.producer_done

    def produce(self, value) -> None:
        if not self.free():
            raise RuntimeError(f"register {self.name} overflows its {self.slots} slots")
        self.entries.append(value)
        self.occupied += 1
        self.peak = max(self.peak, self.occupied)

    def take(self):
        return self.entries.popleft()

    def release(self) -> None:
        self.occupied -= 1


@dataclass
class Pending:
    """Asynchronous work an actor started: ``poll()`` returns None until done, then the output values."""

    poll: object  # () -> tuple | None


@dataclass
class Actor:
    """Fires ``count`` times, when each input has an entry it may read and each output a free slot;
    ``body(index, inputs) -> outputs`` (a tuple, one value per output) or Pending. The inputs' slots are
    released when the body returns."""

    name: str
    body: object
    count: int
    inputs: list[Register] = field(default_factory=list)
    outputs: list[Register] = field(default_factory=list)
    kind: str = "compute"  # "compute" or "transfer": how the timeline draws it
    fired: int = 0
    busy: bool = False  # an asynchronous firing is under way

    def ready(self) -> bool:
        return (
            not self.busy
            and self.fired < self.count
            and all(r.readable() for r in self.inputs)
            and all(r.free() for r in self.outputs)
        )


@dataclass
class Event:
    """What one actor did: ``index``-th firing from ``start`` to ``end`` (seconds, time.perf_counter)."""

    actor: str
    kind: str
    index: int
    start: float
    end: float


class Runtime:
    """The actors of one rank and the loop that runs them."""

    def __init__(self, check=None, check_every: float = 0.01):
        self.actors: list[Actor] = []
        self.pending: list[tuple[Actor, int, float, Pending]] = []
        self.events: list[Event] = []
        self.check = check  # () -> None, called while idle; raises to stop (e.g. a failure elsewhere)
        self.check_every = check_every
        self._wakeup = threading.Event()

    def notify(self) -> None:
        """Wake the loop: some Pending may be done (thread-safe; what asynchronous work calls when it ends)."""
        self._wakeup.set()

    def add(self, actor: Actor) -> Actor:
        self.actors.append(actor)
        return actor

    def _finish(self, actor: Actor, index: int, start: float, values) -> None:
        for reg, value in zip(actor.outputs, values):
            reg.produce(value)
        actor.fired += 1
        if actor.fired == actor.count:
            for reg in actor.outputs:
                reg.producer_done = True
        self.events.append(Event(actor.name, actor.kind, index, start, time.perf_counter()))

    def _fire(self, actor: Actor) -> None:
        index, start = actor.fired, time.perf_counter()
        inputs = [reg.take() for reg in actor.inputs]
        out = actor.body(index, inputs)
        for reg in actor.inputs:
            reg.release()
        if isinstance(out, Pending):
            actor.busy = True
            self.pending.append((actor, index, start, out))
        else:
            self._finish(actor, index, start, out)

    def _poll(self) -> None:
        for item in list(self.pending):
            actor, index, start, work = item
            values = work.poll()
            if values is not None:
                self.pending.remove(item)
                actor.busy = False
                self._finish(actor, index, start, values)

    def run(self) -> None:
        """Fire actors until each has fired ``count`` times."""
        while True:
            self._poll()
            if all(a.fired == a.count for a in self.actors):
                return
            actor = next((a for a in self.actors if a.ready()), None)
            if actor is not None:
                self._fire(actor)
                continue
            if not self.pending:
                stuck = [f"{a.name} ({a.fired}/{a.count})" for a in self.actors if a.fired < a.count]
                raise RuntimeError(f"actor graph is stuck: nothing ready and nothing in flight: {stuck}")
            # idle: sleep until asynchronous work ends (or check_every passes, to check for failures)
            if not self._wakeup.wait(self.check_every) and self.check is not None:
                self.check()
            self._wakeup.clear()
