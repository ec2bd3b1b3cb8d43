"""Joining the default process group in a way that survives ``torchrun --max-restarts``."""

import datetime
import os

import torch.distributed as dist


def init_process_group(backend: str = "gloo", timeout: datetime.timedelta | None = None) -> None:
    """``torch.distributed.init_process_group(backend, timeout=timeout)`` for a job that ``torchrun`` may restart.

    Under torchrun, every attempt rendezvouses on the agent's store under a prefix of its own (the restart
    count). ``init_process_group``'s ``env://`` form keys the first attempt's addresses the same way in every
    attempt, so after a restart gloo reads the dead workers' addresses and fails to connect. Outside torchrun
    this is ``init_process_group`` itself. ``timeout`` is the collective timeout every placement's groups use."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    kwargs = {} if timeout is None else {"timeout": timeout}
    if attempt is None:
        dist.init_process_group(backend, **kwargs)
        return
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, is_master=False,
        timeout=timeout or datetime.timedelta(minutes=5),
    )  # fmt: skip
    dist.init_process_group(
        backend, store=dist.PrefixStore(f"attempt-{attempt}/", store), rank=rank, world_size=size, **kwargs
    )
