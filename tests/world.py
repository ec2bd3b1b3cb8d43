"""Multi-rank test harness: run test bodies on a real gloo process group.

``run_on_world(n, fn, *args, **kwargs)`` runs ``fn(*args, **kwargs)`` on every
rank of an ``n``-rank world and returns the per-rank results (index = rank).
Inside ``fn`` the default ``torch.distributed`` group is that world.

Starting processes and rendezvousing costs seconds, so each world size gets one
set of spawned workers, started lazily and reused for the whole session.  A
world whose call failed (exception, timeout, dead worker) may be stuck in or
out of step in a collective, so it is killed; the next call starts a fresh one.
Before a world that did not answer is killed, every rank prints the stacks of all
its threads (``faulthandler``), and the failure message carries them.

``fn`` travels by reference (module + qualname), so it must be a module-level
function of an importable module (test modules are: workers put ``tests/`` and
the repo root on ``sys.path``).
"""

import atexit
import datetime
import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

__all__ = ["RankFailure", "run_on_world", "shutdown_worlds"]

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
PG_TIMEOUT = datetime.timedelta(seconds=60)  # collectives/rendezvous inside the workers
START_TIMEOUT = 120.0  # seconds for a fresh world to import torch and rendezvous
GRACE = 3.0  # after one rank fails, how long to wait for the others' results


class RankFailure(AssertionError):
    """Some ranks raised, died or did not answer.

    ``failures`` maps rank -> formatted traceback (or death notice);
    ``missing`` lists the ranks that gave no answer in time.
    """

    def __init__(self, message, failures, missing):
        super().__init__(message)
        self.failures, self.missing = failures, missing


def _worker(rank, size, port, conn, stack_path):
    """Worker main loop: join the gloo world, then run jobs until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled by the parent
    stacks = open(stack_path, "w")  # noqa: SIM115 - open for the worker's life: SIGUSR1 writes here
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    for path in (REPO_ROOT, TESTS_DIR):
        if path not in sys.path:
            sys.path.insert(0, path)
    torch.set_num_threads(1)  # N workers share a few cores
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo" if sys.platform == "linux" else "lo0")
    try:
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=PG_TIMEOUT)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=PG_TIMEOUT)
    except BaseException:
        conn.send(("err", traceback.format_exc()))
        return
    try:
        conn.send(("ok", os.getpid()))
        while data := conn.recv_bytes():  # an empty message means "shut down"
            try:
                fn, args, kwargs = pickle.loads(data)
                conn.send(("ok", fn(*args, **kwargs)))  # an unpicklable result fails here
            except BaseException:
                conn.send(("err", traceback.format_exc()))
    except (EOFError, OSError):
        pass  # the parent went away
    finally:
        dist.destroy_process_group()  # gloo may abort noisily at exit otherwise


class _World:
    """The spawned workers of one world size, plus the TCPStore they meet at."""

    def __init__(self, size):
        self.size = size
        # The parent hosts the rendezvous store on a kernel-chosen port: no port races.
        self.store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, timeout=PG_TIMEOUT, wait_for_workers=False)
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        self.stack_dir = tempfile.mkdtemp(prefix=f"world{size}-")
        self.stack_paths = [os.path.join(self.stack_dir, f"rank{rank}.txt") for rank in range(size)]
        for rank in range(size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(
                target=_worker,
                args=(rank, size, self.store.port, child_end, self.stack_paths[rank]),
                name=f"world{size}-rank{rank}",
                daemon=True,
            )
            proc.start()
            child_end.close()  # so that a dead worker reads as EOF on parent_end
            self.procs.append(proc)
            self.conns.append(parent_end)
        self.gather(f"starting the {size}-rank world", START_TIMEOUT)  # all ranks joined

    def alive(self):
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, args, kwargs, timeout):
        payload = pickle.dumps((fn, args, kwargs))  # fails here, in the parent, for lambdas
        for conn in self.conns:
            conn.send_bytes(payload)
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
        return self.gather(f"run_on_world({self.size}, {name})", timeout)

    def gather(self, what, timeout):
        """One reply per rank; on any failure kill the world and raise RankFailure."""
        results, failures = {}, {}
        deadline = time.monotonic() + timeout
        while len(results) + len(failures) < self.size:
            pending = [r for r in range(self.size) if r not in results and r not in failures]
            left = deadline - time.monotonic()
            if left <= 0:
                break
            waitables = {self.conns[r]: r for r in pending}
            waitables.update({self.procs[r].sentinel: r for r in pending})
            for obj in mp.connection.wait(list(waitables), timeout=left):
                rank = waitables[obj]
                if rank in results or rank in failures:
                    continue  # both its pipe and its sentinel were ready
                try:
                    if not self.conns[rank].poll():
                        raise EOFError  # the process ended without writing anything
                    status, value = self.conns[rank].recv()
                except (EOFError, OSError):
                    self.procs[rank].join(1)
                    status, value = "err", f"worker died (exit code {self.procs[rank].exitcode})\n"
                (results if status == "ok" else failures)[rank] = value
                if failures:  # the others may be blocked in a collective waiting for it
                    deadline = min(deadline, time.monotonic() + GRACE)
        if len(results) == self.size:
            return [results[r] for r in range(self.size)]
        missing = [r for r in range(self.size) if r not in results and r not in failures]
        stacks = self.stacks(missing)
        self.kill()
        lines = [f"{what} failed on rank(s) {sorted(failures)}" if failures else f"{what} timed out after {timeout:g}s"]
        if missing:
            lines.append(f"rank(s) {missing} did not answer (blocked or hung; world killed)")
        for rank in sorted(failures):
            lines.append(f"--- rank {rank} ---\n{failures[rank].rstrip()}")
        for rank, stack in stacks.items():
            lines.append(f"--- rank {rank} was here (all threads) ---\n{stack.rstrip()}")
        raise RankFailure("\n".join(lines), failures, missing)

    def stacks(self, ranks) -> dict:
        """The stacks of all threads of each of ``ranks`` that is alive, as each printed them just now."""
        for rank in ranks:
            if self.procs[rank].is_alive():
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
        time.sleep(0.5)  # faulthandler writes from a signal handler: give it a moment
        found = {}
        for rank in ranks:
            try:
                with open(self.stack_paths[rank]) as f:
                    found[rank] = f.read()
            except OSError:
                pass
        return {rank: text for rank, text in found.items() if text}

    def shutdown(self):
        """Ask workers to leave the process group and exit; kill the stragglers."""
        for conn in self.conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        deadline = time.monotonic() + 10
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self):
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(5)
        for conn in self.conns:
            conn.close()
        _worlds.pop(self.size, None)


_worlds = {}  # world size -> live _World
worlds_allowed = True  # False inside a test not marked gloo or gpu (see conftest.py)


def run_on_world(n, fn, *args, _timeout=120.0, **kwargs):
    """Run ``fn(*args, **kwargs)`` on each rank of the ``n``-rank world; return the results.

    Raises RankFailure (an AssertionError) naming the ranks that raised, died or
    did not answer within ``_timeout`` seconds, with their tracebacks.
    """
    if not worlds_allowed:
        raise RuntimeError(
            "run_on_world in a test that is not marked gloo (or gpu): mark it, so that its tier holds it"
        )
    world = _worlds.get(n)
    if world is None or not world.alive():
        if world is not None:
            world.kill()
        world = _worlds[n] = _World(n)
    return world.run(fn, args, kwargs, _timeout)


@atexit.register
def shutdown_worlds():
    """Shut every world down cleanly (called at session end and at exit)."""
    for world in list(_worlds.values()):
        world.shutdown()
