"""What the planner reports while it searches: a one-line bar on a terminal, a line per mesh elsewhere."""

from __future__ import annotations

import sys
import time

import torch.distributed as dist

_WIDTH = 24  # characters of the bar itself


class Progress:
    """The search's progress on stderr: meshes done of all, traces run, seconds so far.

    ``shown`` None (the default of ``plan(progress=)``): shown where stderr is a terminal, by rank 0 of a
    process group only. On a terminal the line is redrawn in place after each trace; elsewhere (a log, a
    pipe) one line is written per mesh finished, so that logs stay short."""

    def __init__(self, meshes: int, shown: bool | None):
        terminal = sys.stderr.isatty()
        first_rank = not dist.is_initialized() or dist.get_rank() == 0
        self.shown = first_rank and (terminal if shown is None else bool(shown))
        self.terminal = terminal
        self.meshes, self.done, self.traces = meshes, 0, 0
        self.current = ""
        self.started = time.perf_counter()

    def mesh(self, label: str) -> None:
        """A mesh's search begins."""
        self.current = label
        self._draw()

    def traced(self) -> None:
        self.traces += 1
        if self.terminal:
            self._draw()

    def mesh_done(self) -> None:
        self.done += 1
        if self.terminal:
            self._draw()
        elif self.shown:
            print(self._line(), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.shown and self.terminal:
            print(file=sys.stderr, flush=True)

    def _line(self) -> str:
        filled = _WIDTH * self.done // max(self.meshes, 1)
        bar = "#" * filled + "." * (_WIDTH - filled)
        seconds = time.perf_counter() - self.started
        return f"planning [{bar}] mesh {self.done}/{self.meshes} {self.current}, {self.traces} traces, {seconds:.1f} s"

    def _draw(self) -> None:
        if self.shown and self.terminal:
            print("\r" + self._line(), end="", file=sys.stderr, flush=True)
