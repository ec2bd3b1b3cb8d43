"""``save`` and ``load`` of a training state through ``torch.distributed.checkpoint``, and the full state on one
rank. The state is a dict whose values are tensors (global or plain), nested dicts and lists of them, plain
values, or objects with ``state_dict``/``load_state_dict`` (modules, optimizers), as DCP takes them."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.stateful import Stateful

from .._layout import Partial, Placement, broadcast, partials_as_broadcast
from .._tensor import GlobalTensor
from ._planners import CheckedLoadPlanner
from ._storage import CheckpointError, Reader, Writer, read_metadata


def _map_tensors(value, fn):
    """``value`` with every tensor ``t`` in it replaced by ``fn(t)``, in new containers."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return type(value)((key, _map_tensors(item, fn)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(item, fn) for item in value)
    return value


def _is_partial(t: torch.Tensor) -> bool:
    return isinstance(t, GlobalTensor) and any(isinstance(s, Partial) for s in t.sbp)


def _reduced(t: torch.Tensor) -> torch.Tensor:
    # a partial tensor's parts are not values: its reduced value, laid out with each partial axis broadcast
    return t.detach().to_global(sbp=partials_as_broadcast(t.sbp)) if _is_partial(t) else t


def _failed_on(what: str, failures: dict[int, str]) -> CheckpointError:
    """The error that names the ranks where ``what`` failed and each one's error."""
    lines = "; ".join(f"rank {rank}: {text}" for rank, text in sorted(failures.items()))
    return CheckpointError(f"{what} failed on rank(s) {sorted(failures)}: {lines}")


def _unwrapped(err: CheckpointException, what: str) -> CheckpointError:
    """DCP's report of ranks that failed inside it (a BaseException) as a ``CheckpointError``: the error itself
    where it is one (a metadata problem, raised by every rank alike), else naming the ranks and their errors."""
    causes = {rank: failure[0] if isinstance(failure, tuple) else failure for rank, failure in err.failures.items()}
    for cause in causes.values():
        if isinstance(cause, CheckpointError):
            return cause
    return _failed_on(what, {rank: f"{type(cause).__name__}: {cause}" for rank, cause in causes.items()})


def _raise_everywhere(failure: BaseException | None, what: str) -> None:
    """Raise on every rank if ``failure`` is not None on some rank: this rank's own error as it is (its message
    names the entry), elsewhere a ``CheckpointError`` naming the ranks that failed and why."""
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, None if failure is None else f"{type(failure).__name__}: {failure}")
    failed = {rank: outcome for rank, outcome in enumerate(outcomes) if outcome is not None}
    if not failed:
        return
    if isinstance(failure, CheckpointError):
        raise failure
    raise _failed_on(what, failed) from failure


def _state_dicts(state: dict) -> dict:
    """``state`` with each object that has ``state_dict``/``load_state_dict`` (a module, an optimizer) replaced
    by its state dict, as DCP takes it."""
    return {key: value.state_dict() if isinstance(value, Stateful) else value for key, value in state.items()}


def save(state: dict, path: str | os.PathLike, *, sync_files: bool = True) -> None:
    """Save ``state`` to the checkpoint ``path``; every rank calls it with the same keys.

    Each rank writes the boxes of the global tensors it holds, each box once (where a broadcast axis repeats
    it, DCP picks the writer); partial tensors are reduced on the way out; plain tensors and values are written
    once. Nothing is gathered to one rank. ``path`` is published only when every rank has finished: an
    interrupted save leaves the previous checkpoint at ``path`` loadable."""
    to_save = _map_tensors(_state_dicts(state), _reduced)
    try:
        dcp.save(to_save, storage_writer=Writer(path, sync_files), planner=DefaultSavePlanner())
    except CheckpointException as err:
        raise _unwrapped(err, f"saving {path}") from err


def load(state: dict, path: str | os.PathLike) -> None:
    """Load the checkpoint ``path`` into ``state`` in place, resharding to the layouts the state holds now
    (another world size, placement, SBPs). Modules and optimizers in ``state`` get ``load_state_dict``. An
    optimizer ends up with state for the parameters the checkpoint holds state for, as ``load_state_dict`` of
    plain torch leaves it: state made first for those that have none here (zero moments in their layouts: a fresh
    optimizer, a parameter that took no gradient yet, another pipeline stage's), and dropped for the others.

    Each rank reads only the rows of the stored boxes that its own parts need. If the checkpoint's keys, shapes
    or dtypes differ from the state's, raises ``CheckpointError`` on every rank, naming each difference, before
    any value changes (an optimizer state made for the load is dropped again)."""
    try:
        reader, failure = Reader(path, read_metadata(Path(path))), None
    except CheckpointError as err:  # missing, half written or corrupt metadata
        reader, failure = None, err
    _raise_everywhere(failure, f"loading {path}")
    stored = reader.metadata.state_dict_metadata
    undo = [
        _state_as_stored(value, _stored_parameters(key, stored))
        for key, value in state.items()
        if isinstance(value, torch.optim.Optimizer)
    ]
    partial_targets = []

    def target(t: torch.Tensor) -> torch.Tensor:
        if not _is_partial(t):
            return t
        stand_in = torch.zeros_like(t.detach()).to_global(sbp=partials_as_broadcast(t.sbp))
        partial_targets.append((t, stand_in))
        return stand_in

    to_load = _map_tensors(_state_dicts(state), target)
    # Each rank plans and reads on its own (no_dist): a load plan needs nothing from other ranks, and DCP's
    # exchange of every rank's pickled plan through rank 0 would cost more than the reading on small states.
    # One exchange of outcomes afterwards makes every rank raise if one did.
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(to_load, storage_reader=reader, planner=CheckedLoadPlanner(), no_dist=True)
    except CheckpointException as err:
        failure = _unwrapped(err, f"loading {path}")
    except (CheckpointError, OSError) as err:
        failure = err
    try:
        _raise_everywhere(failure, f"loading {path}")
    except CheckpointError:
        for put_back in undo:
            put_back()
        raise
    with torch.no_grad():
        for original, stand_in in partial_targets:
            original.copy_(stand_in)  # a global copy: lays the value out as the partial layout says
    stand_ins = {id(stand_in): original for original, stand_in in partial_targets}
    loaded = _map_tensors(to_load, lambda t: stand_ins.get(id(t), t))
    for key, value in state.items():
        if isinstance(value, Stateful):
            value.load_state_dict(loaded[key])
        else:
            state[key] = loaded[key]


def _stored_parameters(key: str, stored) -> set[int]:
    """The positions of the parameters whose state the checkpoint holds for the optimizer saved under ``key``."""
    prefix = f"{key}.state."
    return {int(name[len(prefix) :].split(".", 1)[0]) for name in stored if name.startswith(prefix)}


def _state_as_stored(optimizer: torch.optim.Optimizer, positions: set[int]):
    """Have ``optimizer`` hold state for the parameters at ``positions`` alone: the others' dropped, made for those
    that have none. Returns what puts the state back as it was (a load that fails)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    wanted = {id(params[i]): params[i] for i in positions if i < len(params)}
    dropped = {p: optimizer.state.pop(p) for p in list(optimizer.state) if id(p) not in wanted}
    made = [p for p in wanted.values() if p not in optimizer.state]
    if made:
        _make_state(optimizer, made)

    def put_back():
        for p in made:
            optimizer.state.pop(p, None)
        optimizer.state.update(dropped)

    return put_back


def _make_state(optimizer: torch.optim.Optimizer, made: list) -> None:
    """Give the parameters ``made`` of ``optimizer`` their state, by one step with zero gradients on them alone
    (the others' are None for it: skipped) and a learning rate of 0 (parameters do not change). Gradients are put
    back."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    rates = [group.get("lr") for group in optimizer.param_groups]
    chosen = {id(p) for p in made}
    for p in params:
        p.grad = torch.zeros_like(p) if id(p) in chosen else None
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for group, rate in zip(optimizer.param_groups, rates):
            if rate is not None:
                group["lr"] = rate
        for p, grad in zip(params, grads):
            p.grad = grad


def full_state_dict(source, rank: int = 0) -> dict:
    """The state of ``source`` (a module, an optimizer, or a state dict) as plain CPU tensors on ``rank``, the
    logical values; an empty dict on every other rank. Every rank calls it. Global tensors travel to ``rank``
    one at a time, partial ones reduced on the way, so other ranks hold no more than their own parts. Ranks may
    hold different entries (a pipeline's optimizer holds state for its own stages' parameters): the result holds
    them all. It loads with ``torch.load(..., weights_only=True)`` once saved, and into ``safetensors`` files."""
    state = source.state_dict() if hasattr(source, "state_dict") else source
    here = dist.get_rank() == rank

    def gathered(t: torch.Tensor) -> torch.Tensor | None:
        if isinstance(t, GlobalTensor):
            one = Placement(t.placement.type, ranks=[rank])
            t = t.detach().to_global(one, (broadcast,)).to_local()
        return t.detach().to("cpu", copy=True) if here else None  # (a copy: the state goes on changing)

    held = dict(_entries(state))
    keys = [None] * dist.get_world_size()
    dist.all_gather_object(keys, sorted(held, key=repr))
    if all(k == keys[0] for k in keys):  # (the common case: one state dict on every rank)
        out = _map_tensors(state, gathered)
        return out if here else {}
    described = [None] * dist.get_world_size()
    dist.all_gather_object(described, {path: _described(value) for path, value in held.items()})
    # Ranks hold state for different parameters (a pipeline's optimizer steps its own stages' alone): every rank
    # walks every entry, in one order, with a stand-in for one it lacks, so that the transfers pair up.
    union = {}
    for entries in described:
        for path, description in entries.items():
            union.setdefault(path, description)
    lacking = [path for path, (kind, _) in union.items() if kind == "large" and path not in described[rank]]
    if lacking:  # (alike on every rank: all read the same descriptions)
        raise ValueError(
            f"full_state_dict: rank {rank} lacks the plain tensor(s) {lacking}, which other ranks hold; a plain "
            "tensor travels only where every rank holds it: lay it out as a global tensor"
        )
    out = {}
    for path in sorted(union, key=repr):
        kind, value = union[path]
        if path in held:
            value = held[path]
        elif kind == "global":  # (a rank outside its placement)
            value = GlobalTensor(torch.empty(0, dtype=value.dtype, device=value.placement.type), value)
        leaf = gathered(value) if isinstance(value, torch.Tensor) else value
        if here:
            _insert(out, path, leaf)
    return out if here else {}


def _entries(state, path=()):
    """(path, value) of every entry that is not a dict, through nested dicts."""
    for key, value in state.items():
        if isinstance(value, dict):
            yield from _entries(value, (*path, key))
        else:
            yield (*path, key), value


def _described(value):
    """What another rank needs of an entry it lacks: a global tensor's metadata, or the value itself (a plain tensor
    only if small: an optimizer's step count, say)."""
    if isinstance(value, GlobalTensor):
        return "global", value._meta
    if isinstance(value, torch.Tensor):
        return ("value", value.detach().cpu()) if value.numel() <= 64 else ("large", None)
    return "value", value


def _insert(out: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        out = out.setdefault(key, {})
    out[path[-1]] = value
