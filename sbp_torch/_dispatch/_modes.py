"""Dispatch modes, per thread and per ``contextvars`` context: strict mode and implicit broadcast. A pipeline's transfer
lanes are threads, and a mode set by one must not change what another does; each thread starts with the defaults (strict
mode: the environment variable ``SBP_TORCH_STRICT``)."""

import contextlib
import contextvars
import os

STRICT = contextvars.ContextVar("sbp_torch_strict", default=os.environ.get("SBP_TORCH_STRICT", "") not in ("", "0"))
# False, or how plain tensors from user code are taken: "unchecked" or "checked" (see ``implicit_broadcast``)
IMPLICIT_BROADCAST = contextvars.ContextVar("sbp_torch_implicit_broadcast", default=False)


def set_strict(strict: bool) -> None:
    """In strict mode an op that would take the broadcast fallback raises instead (for developers finding ops
    that need a rule). Applies to the calling thread (context) from now on; ``SBP_TORCH_STRICT=1`` makes it
    every thread's default. ``strict()`` is the scoped form."""
    STRICT.set(bool(strict))


@contextlib.contextmanager
def strict(enabled: bool = True):
    """Strict mode (see ``set_strict``) within the block."""
    token = STRICT.set(bool(enabled))
    try:
        yield
    finally:
        STRICT.reset(token)


@contextlib.contextmanager
def implicit_broadcast(check: bool = False):
    """Within this block a plain tensor with dims that user code passes to an op beside a global tensor is taken
    as that tensor broadcast on its placement, like DTensor's ``implicit_replication``. It must hold the same
    values on every rank, and it is a constant: it gets no gradient.

    With ``check=True``, the first time each call site meets a plain tensor of a given shape and dtype, every
    rank's values are compared (a fingerprint exchanged over the world); where they differ, every rank raises
    ``MixedTensorError`` naming the op. Later calls at that site and shape are not checked again. Unchecked, a
    plain tensor that differs between ranks gives silently wrong results; the unchecked form is for speed."""
    token = IMPLICIT_BROADCAST.set("checked" if check else "unchecked")
    try:
        yield
    finally:
        IMPLICIT_BROADCAST.reset(token)
