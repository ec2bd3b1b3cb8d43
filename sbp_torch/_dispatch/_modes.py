"""Dispatch modes, per thread and per ``contextvars`` context: strict mode and implicit broadcast. A pipeline's transfer
lanes are threads, and a mode set by one must not change what another does; each thread starts with the defaults (strict
mode: the environment variable ``SBP_TORCH_STRICT``)."""

import contextlib
import contextvars
import os

STRICT = contextvars.ContextVar("sbp_torch_strict", default=os.environ.get("SBP_TORCH_STRICT", "") not in ("", "0"))
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
def implicit_broadcast():
    """Within this block a plain tensor meeting a global tensor in an op is taken as that tensor broadcast on
    its placement, like DTensor's ``implicit_replication``. Only for values equal on every rank (index lists,
    masks, constants that torch's own formulas build): nothing checks that, and differing values would give
    silently wrong results. Such a tensor is a constant: it gets no gradient."""
    token = IMPLICIT_BROADCAST.set(True)
    try:
        yield
    finally:
        IMPLICIT_BROADCAST.reset(token)
