"""Host synchronisations in training steps on one GPU, as CUDA's sync debug mode reports them: plain PyTorch against
sbp_torch on a one-rank placement.

    python diagnostics/sync_check.py [--steps 3]

For each model of the ``gpt_cuda`` suite at its ``--quick`` sizes (the GPT example and an unmodified ``transformers``
GPT-2 with ``sdpa`` attention), plain and laid out as that suite lays it out (``Module.to_global``, the batch
``split(0)``), three steps warm the caches up (laying out the batch, forward, loss, backward, AdamW with
``foreach=True``, ``zero_grad``), then ``--steps`` more run under ``torch.cuda.set_sync_debug_mode("warn")``. Every
synchronisation reported is printed with the Python stack it happened under, then the counts.

A synchronisation is sbp_torch's when its stack passes through ``sbp_torch/`` and the plain steps have none from the
same caller line (the innermost frame outside torch and sbp_torch: the model's, or this script's step for torch's
optimizer); one that the plain steps have too is the caller's own (a value the model reads). The exit status is 1 when
there is any of sbp_torch's. Without CUDA there is nothing to check: it says so and exits 0.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import socket
import sys
import traceback
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from zoo import gpt as gpt_models  # noqa: E402

WARM_UP = 3
TORCH = os.path.dirname(torch.__file__) + os.sep
SBP_TORCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sbp_torch") + os.sep


def _caller(stack: list) -> str | None:
    """The innermost frame outside torch, sbp_torch and the warnings machinery, as ``file:line``."""
    for frame in reversed(stack):
        if not frame.filename.startswith((TORCH, SBP_TORCH)) and not frame.filename.endswith("warnings.py"):
            return f"{frame.filename}:{frame.lineno}"
    return None  # a thread of autograd's engine: no frame of the step's own


@contextlib.contextmanager
def _synchronisations(found: list):
    """Append the stack of each synchronisation that the sync debug mode reports within the block to ``found``."""

    def record(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing CUDA operation" in str(message):  # (not set_sync_debug_mode's own warning)
            found.append(traceback.extract_stack()[:-1])

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record  # called where the warning is raised, in the thread that raised it
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def _steps(name: str, library: str, c: dict, batches: list, steps: int) -> list:
    """The stacks of the synchronisations of ``steps`` steps after the warm-up."""
    model, loss_of = gpt_models.make_model(name, c, "cuda")
    model, lay_out, _ = gpt_models.laid_out(library, model, "cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    found = []
    for i in range(WARM_UP + steps):
        with _synchronisations(found) if i >= WARM_UP else contextlib.nullcontext():
            loss = loss_of(model, lay_out(batches[i % len(batches)]))  # each step lays its batch out
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return found


def _print_stack(stack: list) -> None:
    callers = [i for i, frame in enumerate(stack) if f"{frame.filename}:{frame.lineno}" == _caller(stack)]
    for frame in stack[callers[0] if callers else 0 :]:
        print(f"      {frame.filename}:{frame.lineno} in {frame.name}\n        {frame.line}")


def check(name: str, c: dict, batches: list, steps: int) -> int:
    """Print the synchronisations of ``name``'s plain and global steps; returns how many are sbp_torch's."""
    plain = _steps(name, "plain", c, batches, steps)
    laid_out = _steps(name, "sbp_torch", c, batches, steps)
    callers_of_plain = collections.Counter(_caller(stack) for stack in plain)
    ours = []
    for stack in laid_out:
        if not any(frame.filename.startswith(SBP_TORCH) for frame in stack):
            continue
        if callers_of_plain[_caller(stack)] > 0:
            callers_of_plain[_caller(stack)] -= 1  # the model's own: the plain step has it too
        else:
            ours.append(stack)
    for title, stacks in (("plain", plain), ("sbp_torch", laid_out)):
        for i, stack in enumerate(stacks):
            mark = " (sbp_torch's)" if any(stack is o for o in ours) else ""
            print(f"  {name}, {title}, synchronisation {i + 1}{mark}:")
            _print_stack(stack)
    print(f"{name}: {steps} steps: plain {len(plain)} synchronisations, sbp_torch {len(laid_out)}, sbp_torch's own "
          f"{len(ours)}", flush=True)  # fmt: skip
    return len(ours)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="steps observed after the warm-up")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA: no synchronisation to check")
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        c = gpt_models.config(cuda=True, quick=True)
        generator = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, c["vocab"], (c["batch"], c["seq"]), generator=generator).cuda() for _ in range(3)]
        ours = sum(check(name, c, batches, args.steps) for name in gpt_models.MODELS)
    finally:
        dist.destroy_process_group()
    print(f"sbp_torch's synchronisations: {ours}")
    return 1 if ours else 0


if __name__ == "__main__":
    sys.exit(main())
