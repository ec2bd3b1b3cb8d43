"""What every actor did when, on every rank: a Chrome trace (chrome://tracing, Perfetto) and a PNG Gantt chart.

Times are ``time.perf_counter`` seconds, which on Linux is the system-wide monotonic clock, so the ranks of
one machine share it; the chart starts at the earliest event.
"""

import json

COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "transfer": "#55a868", "compute": "#8172b3"}


class Timeline:
    """Events per rank: ``ranks[r]`` is a list of ``(actor, kind, index, start, end)``."""

    def __init__(self, ranks: list[list[tuple]]):
        self.ranks = ranks
        starts = [e[3] for events in ranks for e in events]
        self.origin = min(starts) if starts else 0.0

    def busy_fraction(self, rank: int, kinds=("forward", "backward")) -> float:
        """Share of the step (first to last event of any rank) that ``rank`` spent in actors of ``kinds``."""
        events = [e for ev in self.ranks for e in ev]
        span = max(e[4] for e in events) - min(e[3] for e in events)
        return sum(e[4] - e[3] for e in self.ranks[rank] if e[1] in kinds) / span

    def chrome_trace(self) -> dict:
        """The trace as a dict in the Chrome trace event format (one process per rank, one thread per actor)."""
        out = []
        for rank, events in enumerate(self.ranks):
            out.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
            for actor, kind, index, start, end in events:
                out.append(
                    {
                        "ph": "X",
                        "name": f"{kind} {index}",
                        "cat": kind,
                        "pid": rank,
                        "tid": actor,
                        "ts": (start - self.origin) * 1e6,
                        "dur": (end - start) * 1e6,
                        "args": {"actor": actor, "micro_batch": index},
                    }
                )
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def write_chrome_trace(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)

    def write_png(self, path: str, title: str = "") -> None:
        """A Gantt chart: one row per rank for compute (micro-batch numbers on the bars), a thin row under it
        for transfers in flight."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 0.7 + 0.6 * len(self.ranks)))
        for rank, events in enumerate(self.ranks):
            y = len(self.ranks) - 1 - rank
            for _, kind, index, start, end in events:
                x0, width = (start - self.origin) * 1e3, (end - start) * 1e3
                if kind == "transfer":
                    ax.broken_barh([(x0, width)], (y - 0.45, 0.12), color=COLORS[kind], alpha=0.5)
                    continue
                ax.broken_barh([(x0, width)], (y - 0.3, 0.7), color=COLORS.get(kind, COLORS["compute"]))
                ax.text(x0 + width / 2, y + 0.05, str(index), ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(len(self.ranks)), [f"rank {r}" for r in reversed(range(len(self.ranks)))])
        ax.set_xlabel("ms")
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in list(COLORS.values())[:3]]
        ax.legend(handles, list(COLORS)[:3], loc="upper right", fontsize=7, ncol=3)
        if title:
            ax.set_title(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
