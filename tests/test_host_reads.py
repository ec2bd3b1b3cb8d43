"""A global training step reads no value to the host that the plain step does not read (issue #29).

On a GPU every such read waits for the GPU: ``.item()``, ``bool()``, ``.tolist()``, ``.cpu()``, ops whose output
shape depends on values (``nonzero``, boolean masks, ``unique``), tensors made from Python data (copied from the host).
Here, on the CPU, the reads are counted where sbp_torch would issue them: by a dispatch mode beneath the global tensors
(it leaves each call on global tensors to ``GlobalTensor``, and sees the ops that the dispatch path and the local calls
run on the local parts) and by the tensor methods that read values without an aten op (which also see what runs with
dispatch modes off, such as ``all_gather_object``).

The GPT example and a tiny unmodified ``transformers`` GPT-2, built by ``zoo/gpt.py`` (the GPU benchmark's models),
take AdamW steps plain and laid out on a one-rank placement; each step lays out its batch (``to_global`` broadcast,
then ``split(0)``). A read in the global steps is sbp_torch's when its stack passes through ``sbp_torch/`` and the
plain steps have no read of that op from the same caller line (the innermost frame outside torch and sbp_torch: the
model's, or this file's step for torch's optimizer). The steps counted are the second and later ones: the cached path,
local calls learnt and then taken. On a GPU, ``diagnostics/sync_check.py`` (``scripts/gpu.sh``, stage ``sync_check``)
counts the synchronisations themselves.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from world import run_on_world

aten = torch.ops.aten
STEPS = 4  # the first decides; the second learns the local calls; the third and fourth take them
TORCH = os.path.dirname(torch.__file__) + os.sep
SBP_TORCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sbp_torch") + os.sep

# Ops that always read values to the host (on CUDA: wait for the GPU). Beneath autograd, as within sbp_torch's
# dispatch, torch's composite ops come undecomposed: ``item`` and ``is_nonzero`` besides ``_local_scalar_dense``.
READS = {
    aten._local_scalar_dense.default,  # item(), bool(), int(), float()
    aten.item.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.allclose.default,
    aten.nonzero.default,
    aten.argwhere.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.bincount.default,
}
# Ops that read values with some arguments: (op, whether these arguments make it read).
READS_WITH = {
    aten.lift_fresh.default: lambda args, kwargs: args[0].numel() > 0,  # Python data, copied to the device
    aten.index.Tensor: lambda args, kwargs: _has_mask(args[1]),  # a mask is turned into indices first
    aten.index_put.default: lambda args, kwargs: _has_mask(args[1]),
    aten.index_put_.default: lambda args, kwargs: _has_mask(args[1]),
    aten.repeat_interleave.Tensor: lambda args, kwargs: kwargs.get("output_size") is None,  # its length
    aten.repeat_interleave.self_Tensor: lambda args, kwargs: len(args) < 4 and kwargs.get("output_size") is None,
}
READING_METHODS = ("tolist", "numpy", "cpu")  # no aten op on the CPU; a copy to the host on a GPU


def _has_mask(indices) -> bool:
    return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _caller(stack: list) -> str | None:
    """The innermost frame outside torch and sbp_torch, as ``file:line``."""
    for frame in reversed(stack):
        if not frame.filename.startswith((TORCH, SBP_TORCH)):
            return f"{frame.filename}:{frame.lineno}"
    return None


def _from_sbp_torch(frame) -> bool:
    """Whether sbp_torch called the op (the innermost frame outside torch is sbp_torch's)."""
    while frame is not None and frame.f_code.co_filename.startswith(TORCH):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(SBP_TORCH)


class _HostReads(TorchDispatchMode):
    """Records (what, stack) of each read on plain tensors, and counts the ops that sbp_torch runs on local parts
    (that the mode sees beneath the global tensors at all)."""

    def __init__(self):
        super().__init__()
        self.reads = []
        self.beneath = 0
        self.seen = 0  # every op on plain tensors

    def record(self, what: str, frame) -> None:
        self.reads.append((what, traceback.extract_stack(frame)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from sbp_torch._tensor import GlobalTensor

        kwargs = kwargs or {}
        if any(issubclass(t, GlobalTensor) for t in types):
            return NotImplemented  # GlobalTensor runs the call; its ops on the local parts come back here
        caller = sys._getframe(1)
        self.seen += 1
        if _from_sbp_torch(caller):
            self.beneath += 1
        if func in READS or (func in READS_WITH and READS_WITH[func](args, kwargs)):
            self.record(str(func), caller)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _counting(reads: _HostReads):
    from sbp_torch._frontend import _local_calls

    originals = {name: getattr(torch.Tensor, name) for name in READING_METHODS}

    def reading(name):
        def method(self, *args, **kwargs):
            reads.record(f"Tensor.{name}", sys._getframe(1))
            return originals[name](self, *args, **kwargs)

        return method

    # Local calls stand aside under any dispatch mode; this one only watches, and the steps must take the path
    # they take without it.
    dispatch_modes = _local_calls._dispatch_modes
    _local_calls._dispatch_modes = lambda: dispatch_modes() - 1
    for name in READING_METHODS:
        setattr(torch.Tensor, name, reading(name))
    try:
        with reads:
            yield
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
        _local_calls._dispatch_modes = dispatch_modes


def _reads_of_steps(name: str, library: str, c: dict, batches: list) -> _HostReads:
    from zoo import gpt as gpt_models

    model, loss_of = gpt_models.make_model(name, c, "cpu")
    model, lay_out, _ = gpt_models.laid_out(library, model, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    reads = _HostReads()
    for i, ids in enumerate(batches):
        with _counting(reads) if i > 0 else contextlib.nullcontext():
            loss = loss_of(model, lay_out(ids))  # each step lays its batch out, as a training loop does
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return reads


def _format_from_caller(stack: list) -> str:
    """The frames of ``stack`` from its caller inwards."""
    start = max((i for i, frame in enumerate(stack) if f"{frame.filename}:{frame.lineno}" == _caller(stack)), default=0)
    return "".join(traceback.format_list(stack[start:]))


def reads_of_global_steps(name: str) -> tuple[list[str], int]:
    """(The reads of the global steps that are sbp_torch's, each with its stack; the ops the counter saw sbp_torch
    run beneath the global tensors.)"""
    from zoo import gpt as gpt_models

    c = gpt_models.config(cuda=False, quick=True)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, c["vocab"], (c["batch"], c["seq"]), generator=generator) for _ in range(STEPS)]
    plain = _reads_of_steps(name, "plain", c, batches)
    laid_out = _reads_of_steps(name, "sbp_torch", c, batches)
    left = collections.Counter((what, _caller(stack)) for what, stack in plain.reads)
    ours = []
    for what, stack in laid_out.reads:
        if not any(frame.filename.startswith(SBP_TORCH) for frame in stack):
            continue
        if left[what, _caller(stack)] > 0:
            left[what, _caller(stack)] -= 1  # the caller's own read: the plain step has it too
            continue
        ours.append(f"{what}, called from {_caller(stack)}:\n{_format_from_caller(stack)}")
    return ours, laid_out.beneath


@pytest.mark.gloo
@pytest.mark.parametrize("name", ["GPT example", "transformers GPT-2"])
def test_a_global_step_reads_no_value_that_the_plain_step_does_not(name):
    if name == "transformers GPT-2":
        pytest.importorskip("transformers")
    ((ours, beneath),) = run_on_world(1, reads_of_global_steps, name, _timeout=300)
    assert beneath > 100, f"the counter saw {beneath} ops beneath the global tensors: it no longer sees them"
    assert not ours, f"{len(ours)} reads of sbp_torch's in {STEPS - 1} steps:\n\n" + "\n\n".join(ours)


def reads_of_compiled_steps(name: str) -> tuple[list[str], int]:
    """(The reads of ``compile_step``'s calls after the one that traced (the program alone), each with its stack;
    how many ops the counter saw.)"""
    from zoo import gpt as gpt_models

    c = gpt_models.config(cuda=False, quick=True)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, c["vocab"], (c["batch"], c["seq"]), generator=generator) for _ in range(STEPS)]
    model, loss_of = gpt_models.make_model(name, c, "cpu")
    model, lay_out, _ = gpt_models.laid_out("sbp_torch", model, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    step = gpt_models.whole_step(model, loss_of, lay_out, optimizer, None)  # the graph run as traced: its ops are seen
    reads = _HostReads()
    for i, ids in enumerate(batches):
        with _counting(reads) if i > 1 else contextlib.nullcontext():  # the first runs eagerly, the second traces
            step(ids)
    return [f"{what}:\n{''.join(traceback.format_list(stack[-8:]))}" for what, stack in reads.reads], reads.seen


@pytest.mark.gloo
def test_a_compiled_step_reads_no_value():
    """``compile_step``'s program reads nothing to the host, not even the step counts that AdamW reads eagerly."""
    ((reads, seen),) = run_on_world(1, reads_of_compiled_steps, "GPT example", _timeout=300)
    assert seen > 100, f"the counter saw {seen} ops of the program: it no longer sees them"
    assert not reads, f"{len(reads)} reads in {STEPS - 2} compiled steps:\n\n" + "\n\n".join(reads)
