"""Plain tensors from user code: a torch function called with global tensors and a plain tensor with dims.

Such a plain tensor is one rank's value, and nothing says the other ranks hold the same; taking it as broadcast could
be silently wrong, so the call raises ``MixedTensorError`` naming the op, the shape and the two ways out, unless
``implicit_broadcast`` is on (and then, with ``check=True``, the values are compared across ranks once per call site
and shape). 0-dim tensors pass, as Python scalars do.

This is the boundary between user code and torch: a torch function that user code (or an ``nn.Module``'s forward)
calls on a global tensor comes here first, whatever Python code called it. Plain tensors that torch builds below it,
in C++ composites and backward formulas, never come here (see the dispatcher); nor do those built inside a Python
function of torch's that takes the torch function protocol itself (most of ``torch.nn.functional``), which runs
below this layer as one call.
"""

import hashlib
import sys

import torch

from .. import _comm as comm
from .._comm import compiling
from .._dispatch import IMPLICIT_BROADCAST, MixedTensorError
from .._tensor import OWN_DIR, GlobalTensor, first_outside

_CHECKED: set = set()  # (call site, shape, dtype) whose values every rank was found to agree on


def check_plain_inputs(func, args, kwargs) -> None:
    """Raise ``MixedTensorError`` where user code passes a plain tensor with dims beside global tensors (see the
    module docstring); the hot path, with no plain tensor, is one walk over the arguments."""
    plain = _plain_tensors(args) + (_plain_tensors(kwargs.values()) if kwargs else [])
    if not plain:
        return
    mode = IMPLICIT_BROADCAST.get()
    if mode == "unchecked":
        return
    if mode == "checked":
        _check_values_agree(func, None if compiling() else _call_site(), plain)
        return
    raise MixedTensorError(
        f"{_name(func)}: cannot mix a global tensor with a plain tensor of shape {tuple(plain[0].shape)} from "
        "user code. Either convert it with x.to_global(placement, sbp) first (as a whole tensor on every rank: "
        "to_global(placement, broadcast); as this rank's part: the sbp that says which part), or, if it holds the "
        "same values on every rank, run under sbp_torch.implicit_broadcast(check=True). Tensors built by factories "
        "(torch.arange, torch.zeros, ...) inside a laid-out module's forward, or under sbp_torch.global_mode, are "
        "global already."
    )


def _plain_tensors(values) -> list:
    found = []
    for v in values:
        t = type(v)
        if t is GlobalTensor:
            continue
        if t is list or t is tuple:
            found += _plain_tensors(v)
        elif isinstance(v, torch.Tensor) and not isinstance(v, GlobalTensor) and v.dim():
            found.append(v)
    return found


def _call_site():
    """The nearest caller outside sbp_torch, as (code, line)."""
    frame, _ = first_outside(sys._getframe(1), (OWN_DIR,))
    return None if frame is None else (frame.f_code, frame.f_lineno)


def _check_values_agree(func, site, plain: list) -> None:
    """Compare each plain tensor's values across ranks, once per call site, shape and dtype."""
    keys = [(site, tuple(t.shape), t.dtype) for t in plain]
    todo = [(key, t) for key, t in zip(keys, plain) if key not in _CHECKED]
    if not todo:
        return
    fingerprints = tuple(_fingerprint(t) for _, t in todo)
    try:
        comm.agree(f"{_name(func)} (implicit broadcast, checked)", fingerprints, (), check=True)
    except ValueError as err:
        raise MixedTensorError(
            f"{_name(func)}: a plain tensor of shape {tuple(todo[0][1].shape)} taken as broadcast under "
            "implicit_broadcast(check=True) holds different values on different ranks; convert it with "
            f"to_global(placement, sbp) naming which part each rank holds ({err})"
        ) from None
    _CHECKED.update(key for key, _ in todo)


def _fingerprint(t: torch.Tensor) -> str:
    raw = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
