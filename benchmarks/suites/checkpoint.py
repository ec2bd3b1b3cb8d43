"""Saving and loading a training state: sbp_torch's checkpoints beside DCP with DTensor and beside the disk itself.

The state is the GPT example's model (``examples/gpt.py``) made wider (``WIDTH``, ``VOCAB``, ``LAYERS`` below)
with its AdamW state after one step: model and moments, in float32. It is laid out three ways on 4 ranks, the
example's own plans: ``dp`` (every tensor broadcast), ``tp`` (the Megatron-style plan) and ``dp_tp`` (2x2).

* ``sbp_torch``: ``sbp_torch.checkpoint.save({"model": model, "optim": optimizer}, path)``, then ``load`` of the
  same into a fresh model and optimizer of the same layout (file sync on, as by default).
* ``DTensor``: the same tensors as DTensors (``distribute_tensor`` with each SBP mapped to ``Replicate``/``Shard``
  on a ``DeviceMesh`` of the same ranks), saved with ``dcp.save`` and ``FileSystemWriter`` (its defaults: one file
  per rank, fsync) and loaded with ``dcp.load``.
* ``disk``: what the disk allows: each rank writes the bytes that rank wrote for sbp_torch as one file with
  ``write`` and ``fsync``; to load, each rank reads as many bytes as its own parts hold from those files (in
  ``dp`` every rank holds the whole state), the ranks at the same time.

All three work in the same directory (``CHECKPOINT_DIR``, default a fresh temporary directory), take turns
within each repetition, and time the slowest rank from a common start. Reads come from the page cache where the
file was just written (no cache is dropped), for all three alike. Throughput is the logical state's bytes (each
tensor once) over the time. Peak memory is the most the rank holds from ``malloc`` during the call (sampled
every half millisecond by a thread, through glibc's ``mallinfo2``) above what it held before, as a multiple of
the bytes of the rank's own parts of the state.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import sbp_torch as st
from benchmarks import harness
from sbp_torch.sbp import Split
from zoo.gpt import load_example

TITLE = "Checkpoints: save and load of a training state with sbp_torch, DCP with DTensor, and the disk"
WORLDS = [4]
WIDTH, VOCAB, LAYERS = 512, 16384, 6
LAYOUTS = ["dp", "tp", "dp_tp"]
LIBRARIES = {"sbp_torch": "sbp_torch", "dtensor": "DCP + DTensor", "disk": "disk (write + fsync, read)"}


def _gpt_module():
    module = load_example()
    module.WIDTH, module.VOCAB = WIDTH, VOCAB  # the example's classes read these when built
    return module


def _own_bytes(model, optimizer) -> int:
    tensors = list(model.state_dict().values())
    tensors += [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return sum((t._local if isinstance(t, st.GlobalTensor) else t).nbytes for t in {id(t): t for t in tensors}.values())


def _logical_bytes(model, optimizer) -> int:
    tensors = {id(t): t for t in model.parameters()}
    tensors.update({id(t): t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)})
    return sum(t.numel() * t.element_size() for t in tensors.values())


class _MallocInfo(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
    )]  # fmt: skip


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallocInfo


def _allocated() -> int:
    """Bytes this process holds from malloc now (small blocks in use plus mapped large blocks)."""
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


def _peak_extra(fn) -> tuple[float, int]:
    """(seconds, peak of allocated bytes above the start) of ``fn()``, the time the slowest rank's. A thread
    samples the allocator every half millisecond while ``fn`` runs."""
    base, peak, done = _allocated(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _allocated() - base)
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample)
    dist.barrier()
    sampler.start()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    done.set()
    sampler.join()
    seconds = torch.tensor([elapsed], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item(), peak[0]


def _stepped(gpt, placement, plan):
    torch.manual_seed(0)
    model = gpt.GPT(LAYERS).to_global(placement, plan)
    optimizer = gpt.make_optimizer(model)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _as_dtensors(model, optimizer, mesh: DeviceMesh):
    """The state of the global ``model`` and ``optimizer`` as DTensors of the same layouts."""

    def convert(t):
        full = t.full_tensor()
        return distribute_tensor(full, mesh, [Shard(s.dim) if isinstance(s, Split) else Replicate() for s in t.sbp])

    model_state = {k: convert(v) for k, v in model.state_dict().items() if isinstance(v, st.GlobalTensor)}
    optim_state = optimizer.state_dict()
    optim_state["state"] = {
        i: {k: convert(v) if isinstance(v, st.GlobalTensor) else v for k, v in s.items()}
        for i, s in optim_state["state"].items()
    }
    return {"model": model_state, "optim": optim_state}


def measure(world: int, quick: bool) -> list[dict]:
    gpt = _gpt_module()
    root = os.environ.get("CHECKPOINT_DIR") or tempfile.gettempdir()
    shared = [os.path.join(root, f"sbp_torch_checkpoint_bench_{os.getpid()}") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared)
    here = shared[0]
    repeats = 2 if quick else 5
    rows = []
    for layout in LAYOUTS[:1] if quick else LAYOUTS:
        placement, plan, _ = gpt.plans(world)[layout]
        mesh = DeviceMesh("cpu", torch.tensor(placement.ranks))
        model, optimizer = _stepped(gpt, placement, plan)
        fresh_model, fresh_optimizer = _stepped(gpt, placement, plan)
        dtensor_state = _as_dtensors(model, optimizer, mesh)
        own, logical = _own_bytes(model, optimizer), _logical_bytes(model, optimizer)
        paths = {name: os.path.join(here, layout, name) for name in LIBRARIES}
        if dist.get_rank() == 0:
            for path in paths.values():
                os.makedirs(os.path.dirname(path), exist_ok=True)
        dist.barrier()
        payload = [b""]  # what this rank writes for the disk: as many bytes as it wrote for sbp_torch

        def sbp_save():
            st.checkpoint.save({"model": model, "optim": optimizer}, paths["sbp_torch"])

        def sbp_load():
            st.checkpoint.load({"model": fresh_model, "optim": fresh_optimizer}, paths["sbp_torch"])

        def dt_save():
            dcp.save(dtensor_state, checkpoint_id=paths["dtensor"])

        def dt_load():
            dcp.load(dtensor_state, checkpoint_id=paths["dtensor"])

        def disk_save():
            with open(f"{paths['disk']}.rank{dist.get_rank()}", "wb") as f:
                f.write(payload[0])
                f.flush()
                os.fsync(f.fileno())

        def disk_load():  # the bytes this rank's own parts hold, from the files the ranks wrote
            left = own
            for rank in range(dist.get_world_size()):
                with open(f"{paths['disk']}.rank{rank}", "rb") as f:
                    left -= len(f.read(left))

        timings = {(lib, op): [] for lib in LIBRARIES for op in ("save", "load")}
        peaks = {(lib, op): 0 for lib in LIBRARIES for op in ("save", "load")}
        calls = {
            ("sbp_torch", "save"): sbp_save,
            ("sbp_torch", "load"): sbp_load,
            ("dtensor", "save"): dt_save,
            ("dtensor", "load"): dt_load,
            ("disk", "save"): disk_save,
            ("disk", "load"): disk_load,
        }
        sbp_save()  # warm-up, and the byte count each rank writes, for the disk's own files
        linked = os.path.realpath(paths["sbp_torch"])
        payload[0] = bytes(os.path.getsize(os.path.join(linked, f"rank{dist.get_rank()}.data")))
        for fn in calls.values():
            fn()
        for _ in range(repeats):
            for key, fn in calls.items():
                seconds, extra = _peak_extra(fn)
                timings[key].append(seconds * 1e6)
                peaks[key] = max(peaks[key], extra)
        dist.barrier()
        for (lib, op), samples in timings.items():
            peak = torch.tensor([peaks[lib, op] / own], dtype=torch.float64)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            rows.append(
                {
                    "layout": layout,
                    "library": lib,
                    "op": op,
                    "time": harness.summary(samples),
                    "bytes": logical,
                    "own_bytes": own,
                    "peak_over_own": peak.item(),
                    "code": harness.code_state(),
                }
            )
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(here, ignore_errors=True)
    return rows


def _rate(row) -> str:
    seconds = row["time"]["median_us"] / 1e6
    return f"{row['bytes'] / seconds / 1e6:.0f} MB/s ({seconds * 1e3:.0f} ms)"


def report(rows: list[dict]) -> str:
    by = {(r["layout"], r["library"], r["op"]): r for r in rows}
    header = ["layout", "op"] + [f"{name}" for name in LIBRARIES.values()] + ["sbp_torch / disk time", "peak / own"]
    table = []
    for layout in dict.fromkeys(r["layout"] for r in rows):
        for op in ("save", "load"):
            cells = [_rate(by[layout, lib, op]) if (layout, lib, op) in by else "—" for lib in LIBRARIES]
            sbp, disk = by.get((layout, "sbp_torch", op)), by.get((layout, "disk", op))
            peaks = ", ".join(f"{by[layout, lib, op]['peak_over_own']:.2f}x" for lib in ("sbp_torch", "dtensor"))
            table.append([layout, op, *cells, harness.ratio(sbp["time"], disk["time"]), peaks])
    any_row = rows[0]
    return "\n".join(
        [
            f"State: the GPT example's model at width {WIDTH}, vocabulary {VOCAB}, {LAYERS} layers, with AdamW "
            f"moments: {any_row['bytes'] / 1e6:.1f} MB of logical float32 values. Throughput is those bytes over "
            "the median time (quartiles in the .json); each time is the slowest of the 4 ranks. `peak / own`: the "
            "largest rise of a rank's allocated memory during the call, over the bytes of its own parts "
            "(sbp_torch, DTensor). Written by `benchmarks/suites/checkpoint.py`; its docstring gives the setup.",
            "",
            harness.markdown_table(header, table),
            "",
            f"Code measured: {any_row['code']}.",
        ]
    )
