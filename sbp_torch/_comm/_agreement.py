"""Check that every rank passed the same metadata, before any data moves: mismatched placements, SBPs or dtypes
would make ranks issue different collectives and hang. One exchange over the world lets all raise alike.

Under torch.compile the exchange happens while the program is traced, once per compilation, through the store
(``_compiled.agree_while_compiling``): Dynamo and AOTAutograd trace the call several times, a rank may trace it
fewer times than another (a compile cache), and no collective may run while some ranks trace. The compiled program
holds none of it."""

import hashlib

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from .._layout import refuse_value_dependent
from ._compiled import agree_while_compiling, compiling
from ._faults import collective_failed

# torch's own choice of device for the default group's object collectives (cuda for NCCL, cpu for gloo, ...)
_object_device = dist.distributed_c10d._get_object_coll_device
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (renamed in torch 2.13)

_ROW_DIMS = 8  # dims a part's shape may have for the one-collective exchange (more: the exchange of objects)


def agree(what: str, agreed, local_shape: tuple[int, ...], check: bool) -> list[tuple[int, ...]]:
    """All-gather ``(agreed, local_shape)`` over the world; return every rank's ``local_shape`` (these may
    differ). When ``check``, raise ValueError on every rank if some rank's ``agreed`` (a picklable value) differs
    from rank 0's, naming those ranks; ``what`` names the checked call in messages. In a world of one rank nothing
    is exchanged, so nothing waits for a GPU."""
    if compiling():
        refuse_value_dependent(local_shape, f"{what}: this rank's part")
        local_shape = tuple(int(s) for s in local_shape)
        gathered = agree_while_compiling((what, agreed, local_shape), (agreed, local_shape))
        return _checked(what, gathered, check)
    if dist.get_world_size() == 1:
        # Nothing to compare, and the exchange is not free: all_gather_object through NCCL copies the object to
        # the GPU and back, which waits for the GPU five times, in every step that lays out its batch (issue #29).
        return [tuple(local_shape)]
    try:
        with _disable_current_modes():
            gathered = _exchanged(agreed, tuple(local_shape), check)
    except RuntimeError as err:  # a peer died, or never called the same function
        raise collective_failed(
            f"{what}: the metadata exchange over all {dist.get_world_size()} ranks failed (every rank must make the "
            f"same call); this rank passed {agreed} with local shape {tuple(local_shape)}",
            err,
        ) from err
    return _checked(what, gathered, check)


def _exchanged(agreed, local_shape: tuple[int, ...], check: bool) -> list:
    """Every rank's ``(agreed, local_shape)``, in one all-gather of a row of integers per rank: a digest of
    ``agreed`` (when checked), the number of dims and the shape. Where the digests differ, or a part has more than
    ``_ROW_DIMS`` dims on some rank, every rank (each sees every row) exchanges the values themselves as objects,
    which tells what differs."""
    # (of the repr, not the pickle: a pickled GlobalMeta carries its cached hash, which differs between processes)
    digest = int.from_bytes(hashlib.blake2b(repr(agreed).encode(), digest_size=8).digest(), "little", signed=True)
    fits = len(local_shape) <= _ROW_DIMS
    row = [digest if check else 0, len(local_shape) if fits else -1, *(local_shape if fits else ())]
    device = torch.device(_object_device())  # (where the default group's backend takes tensors)
    mine = torch.tensor(row + [0] * (_ROW_DIMS + 2 - len(row)), dtype=torch.int64, device=device)
    rows = torch.empty(dist.get_world_size() * mine.numel(), dtype=torch.int64, device=device)
    _all_gather(rows, mine)
    rows = rows.view(dist.get_world_size(), -1).tolist()
    if all(r[0] == rows[0][0] and r[1] >= 0 for r in rows):
        return [(agreed, tuple(r[2 : 2 + r[1]])) for r in rows]
    gathered = [None] * len(rows)
    dist.all_gather_object(gathered, (agreed, local_shape))
    return gathered


def _checked(what: str, gathered: list, check: bool) -> list[tuple[int, ...]]:
    if check:
        first = gathered[0][0]
        differing = {r: got for r, (got, _) in enumerate(gathered) if got != first}
        if differing:
            lines = "\n".join(f"  rank {r}: {got}" for r, got in differing.items())
            raise ValueError(f"{what}: ranks passed different metadata; rank 0 passed {first}, but\n{lines}")
    return [shape for _, shape in gathered]
