"""Collectives along one placement axis (an ``AxisGroup``), in the axis' coordinate order, uneven parts included,
and the point-to-point exchange of boxing across placements. Where gloo lacks an uneven collective (all-gather
of unequal parts), the same bytes go through ``all_to_all_single``. A failing or timed-out collective raises
``CollectiveError`` saying what was being waited for."""

import math

import torch
import torch.distributed as dist

from . import _primitives as call
from ._faults import collective_failed
from ._groups import AxisGroup

# dtypes gloo cannot carry, each sent as a wider dtype that holds all its values exactly (so sums, maxima and
# minima are those of the narrow values; a narrowing cast back wraps integer sums as the narrow type would).
_WIDER_ON_WIRE = {
    torch.int16: torch.int32,
    torch.uint16: torch.int32,
    torch.uint32: torch.int64,
    **{
        getattr(torch, name): torch.float32
        for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
        if hasattr(torch, name)
    },
}


def _on_wire(x: torch.Tensor) -> torch.Tensor:
    """``x`` in a dtype every backend can send and reduce: bools as bytes (max/min stay or/and), complex
    numbers as pairs of reals, uint64 as int64 bits (sums wrap alike; max/min are refused), narrow types
    gloo lacks widened."""
    if x.dtype == torch.bool:
        return x.view(torch.uint8)
    if x.is_complex():
        return torch.view_as_real(x.resolve_conj())
    if x.dtype == torch.uint64:
        return x.view(torch.int64)
    if x.dtype in _WIDER_ON_WIRE:
        return x.to(_WIDER_ON_WIRE[x.dtype])
    return x


def _off_wire(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return x.view(torch.bool)
    if dtype.is_complex:
        return torch.view_as_complex(x.contiguous())
    if dtype == torch.uint64:
        return x.view(torch.uint64)
    if dtype in _WIDER_ON_WIRE:
        return x.to(dtype)
    return x


def _to_group_order(group: AxisGroup, items: list) -> list:
    return [items[c] for c in group.coord_of_group_rank]


def _from_group_order(group: AxisGroup, items: list) -> list:
    out = [None] * group.size
    for g, c in enumerate(group.coord_of_group_rank):
        out[c] = items[g]
    return out


def _broadcast(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """The group's index-0 value of ``x`` on every rank; returns a new tensor."""
    return call.broadcast(x.contiguous(), group)


def _all_gather(x: torch.Tensor, dim: int, sizes: list[int], group: AxisGroup) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in axis order; ``sizes[i]`` is rank i's extent of ``dim``."""
    rows = x.movedim(dim, 0).contiguous()
    if len(set(sizes)) == 1:
        out = call.all_gather(rows, group)
        parts = _from_group_order(group, list(out.chunk(group.size)))
    else:
        per_row = math.prod(rows.shape[1:])
        recv_counts = _to_group_order(group, [s * per_row for s in sizes])
        send = rows.reshape(-1).repeat(group.size)
        sent = [rows.numel()] * group.size
        received = call.all_to_all(send, recv_counts, sent, "all-gather (uneven, as all-to-all)", group)
        flat_parts = _from_group_order(group, list(received.split(recv_counts)))
        parts = [p.view(s, *rows.shape[1:]) for p, s in zip(flat_parts, sizes)]
        out = received.view(sum(sizes), *rows.shape[1:])
    if dim == 0 and group.in_rank_order:
        return out  # the parts arrived end to end in row order: the buffer is the result
    return torch.cat([p.movedim(0, dim) for p in parts], dim=dim)  # contiguous, as the global stride says


def _reduce_scatter(x: torch.Tensor, op: str, dim: int, sizes: list[int], group: AxisGroup) -> torch.Tensor:
    """Reduce ``x`` over the group with ``op`` and keep this rank's part ``sizes[index]`` along ``dim``, by one
    tensor-form reduce-scatter (gloo runs the list form as one all-reduce per part). Unequal parts are padded to
    the largest, the padding left as it is: a reduction is element-wise, so whatever it holds only reaches rows
    that are dropped. Equal parts of dim 0 in group order need no buffer at all."""
    rows = x.movedim(dim, 0)
    largest = max(sizes)
    if dim == 0 and min(sizes) == largest and group.in_rank_order and x.is_contiguous():
        send = x
    else:
        send = rows.new_empty((largest * group.size, *rows.shape[1:]))
        for slot, part in enumerate(_to_group_order(group, list(rows.split(sizes)))):
            send[slot * largest : slot * largest + part.shape[0]].copy_(part)
    out = call.reduce_scatter(send, op, group)
    return out[: sizes[group.index]].movedim(0, dim).contiguous()  # as the global stride says


def _all_to_all(
    x: torch.Tensor, split_dim: int, cat_dim: int, send_sizes: list[int], recv_sizes: list[int], group: AxisGroup
) -> torch.Tensor:
    """Re-split: cut ``x`` along ``split_dim`` into ``send_sizes`` (part i goes to rank i), and concatenate
    the parts received along ``cat_dim``, where rank i's part has extent ``recv_sizes[i]``."""
    send_flat, in_counts = _send_buffer(x, split_dim, send_sizes, group)
    recv_shapes = []
    for size in recv_sizes:
        shape = list(x.shape)
        shape[split_dim] = send_sizes[group.index]
        shape[cat_dim] = size
        recv_shapes.append(shape)
    recv_counts = [math.prod(s) for s in recv_shapes]  # (sizes may be data-dependent symbols: no torch.Size)
    out_counts = _to_group_order(group, recv_counts)
    received = call.all_to_all(send_flat, out_counts, in_counts, "all-to-all", group)
    if cat_dim == 0 and group.in_rank_order:  # the parts arrived end to end in row order: the buffer is the result
        shape = list(recv_shapes[0])
        shape[0] = sum(s[0] for s in recv_shapes)
        return received.view(shape)
    parts = _from_group_order(group, list(received.split(out_counts)))
    return torch.cat([p.view(s) for p, s in zip(parts, recv_shapes)], dim=cat_dim)


def _send_buffer(x: torch.Tensor, split_dim: int, sizes: list[int], group: AxisGroup) -> tuple[torch.Tensor, list]:
    """``x`` cut along ``split_dim`` into ``sizes`` (part i for rank i), laid end to end in group order in one
    flat buffer, with one copy at most (none when ``x`` already is that buffer); and the part sizes."""
    parts = _to_group_order(group, list(x.split(sizes, dim=split_dim)))
    counts = [p.numel() for p in parts]
    if split_dim == 0 and group.in_rank_order and x.is_contiguous():
        return x.reshape(-1), counts
    flat = x.new_empty(sum(counts))
    offset = 0
    for part, n in zip(parts, counts):
        flat[offset : offset + n].view(part.shape).copy_(part)
        offset += n
    return flat, counts


def _refuse_unreducible(what: str, x: torch.Tensor, ops: list[str]) -> None:
    if x.dtype == torch.uint64 and any(op in ("max", "min") for op in ops):
        raise TypeError(f"{what}: no backend reduces uint64 by max or min")


def _keeping_dtype(impl):
    def wrapper(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        group = args[-1]
        if group.size == 1:  # one part is the whole: nothing to exchange (and no process group to use)
            return x.clone()
        _refuse_unreducible(impl.__name__.lstrip("_"), x, [a for a in args if isinstance(a, str)])
        return _off_wire(impl(_on_wire(x), *args, **kwargs), x.dtype)

    wrapper.__doc__ = impl.__doc__
    wrapper.__name__ = impl.__name__.lstrip("_")
    return wrapper


broadcast = _keeping_dtype(_broadcast)
all_gather = _keeping_dtype(_all_gather)
reduce_scatter = _keeping_dtype(_reduce_scatter)
all_to_all = _keeping_dtype(_all_to_all)


def send_recv(
    sends: list[tuple[torch.Tensor, int, int]],
    recvs: list[tuple[tuple[int, ...], int, int]],
    like: torch.Tensor,
    holder: torch.Tensor,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Point-to-point over the default group: send each ``(tensor, to rank, tag)`` (cut from ``like``), receive
    each ``(shape, from rank, tag)`` as a tensor of ``like``'s dtype and device. Returns the received tensors and
    ``holder``, the tensor they are to be placed into. Traced, the exchange reads ``like`` and ``holder`` is
    returned in a form computed from the exchange, so the exchange is in every rank's program whatever the rank
    sends or receives (a compiler drops a collective whose result nothing reads, and one whose input nothing
    computed may land in another graph). Everything is posted before anything is waited for, so the order of the
    lists cannot deadlock. Dtypes gloo lacks travel as on the collectives."""
    if call.traced():
        return _send_recv_as_all_to_all(sends, recvs, like, holder)
    # Observed as one exchange over the world, as its traced form is (a rank may put nothing in).
    call.notify(POINT_TO_POINT, _world_group(), lambda: sum(_on_wire(t).nbytes for t, _, _ in sends))
    ops = [dist.P2POp(dist.isend, _on_wire(t).contiguous(), peer, tag=tag) for t, peer, tag in sends]
    buffers = [_on_wire(like.new_empty(shape)) for shape, _, _ in recvs]
    ops += [dist.P2POp(dist.irecv, buf, peer, tag=tag) for buf, (_, peer, tag) in zip(buffers, recvs)]
    if ops:
        try:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        except RuntimeError as err:
            to, source = sorted({peer for _, peer, _ in sends}), sorted({peer for _, peer, _ in recvs})
            raise collective_failed(
                f"point-to-point exchange on rank {dist.get_rank()} (sending to ranks {to}, receiving from ranks "
                f"{source}) of {like.dtype} pieces failed while waiting for the other ranks",
                err,
            ) from err
    return [_off_wire(buf, like.dtype) for buf in buffers], holder


POINT_TO_POINT = "point-to-point exchange"


def generator_state_from(rank: int, device: torch.device) -> None:
    """Every rank of the world takes the state of the random generator for ``device`` that ``rank`` holds: after a
    draw that only some ranks made, the others move on as if they had drawn too (docs/randomness.md)."""
    cuda = device.type == "cuda"
    state = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()
    wire = state.to(device) if cuda else state
    try:
        dist.broadcast(wire, src=rank)
    except RuntimeError as err:
        raise collective_failed(f"the broadcast of rank {rank}'s random generator state over the world", err) from err
    torch.cuda.set_rng_state(wire.cpu(), device) if cuda else torch.set_rng_state(wire)


def _world_group() -> AxisGroup:
    return AxisGroup(tuple(range(dist.get_world_size())), dist.get_rank(), dist.group.WORLD)


def _send_recv_as_all_to_all(sends, recvs, like: torch.Tensor, holder: torch.Tensor):
    """``send_recv`` as one all-to-all over the world, the form a traced graph can hold (there is no functional
    point-to-point op). Every rank of the world takes part, as every rank runs each op of a global program; the
    pieces between two ranks travel end to end in the order of their tags, which both ends list in that order."""
    group = _world_group()
    by_peer = [[] for _ in range(group.size)]
    for tensor, peer, _ in sorted(sends, key=lambda s: s[2]):
        by_peer[peer].append(_on_wire(tensor).reshape(-1))
    wire_like = _on_wire(empty_from(like, (0,)))
    send = torch.cat([piece for pieces in by_peer for piece in pieces] or [wire_like])
    in_counts = [sum(p.numel() for p in pieces) for pieces in by_peer]
    order = sorted(range(len(recvs)), key=lambda i: (recvs[i][1], recvs[i][2]))
    shapes = [(*recvs[i][0], *wire_like.shape[1:]) for i in order]
    out_counts = [0] * group.size
    for i, shape in zip(order, shapes):
        out_counts[recvs[i][1]] += math.prod(shape)
    received = call.all_to_all(send, out_counts, in_counts, POINT_TO_POINT, group)
    pieces = [None] * len(recvs)
    for i, shape, flat in zip(order, shapes, received.split([math.prod(shape) for shape in shapes])):
        pieces[i] = _off_wire(flat.view(shape), like.dtype)
    if holder.numel() == 0:
        holder = _off_wire(empty_from(received, (0,)), like.dtype).reshape(holder.shape)
    else:  # (copies nothing; functionalized, the holder becomes a value computed from the exchange)
        holder.view(-1)[:0].copy_(received[:0])
    return pieces, holder


def empty_from(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``shape``, which holds no element, of ``x``'s dtype and device, made from ``x``. Traced, it is
    computed from ``x``: AOTAutograd puts a collective in the forward or the backward graph by what its input is
    computed from, and a buffer made from nothing would put a rank's collective where the others' is not."""
    return x.as_strided((0,), (1,)).reshape(shape)


def all_reduce(x: torch.Tensor, op: str, group: AxisGroup) -> torch.Tensor:
    """Element-wise ``op`` of ``x`` over the group; returns a new tensor."""
    return start_all_reduce(x, op, group)()


def start_all_reduce(x: torch.Tensor, op: str, group: AxisGroup):
    """Begin ``all_reduce(x, op, group)`` without waiting; returns ``finish()``, which waits and returns the
    result (a new tensor). Lets gradient buckets reduce while backward goes on."""
    if group.size == 1:  # one part is the whole: nothing to exchange (and no process group to use)
        return lambda: x.clone()
    _refuse_unreducible("all_reduce", x, [op])
    started = call.start_all_reduce(_on_wire(x).contiguous(), op, group)
    return lambda: _off_wire(started(), x.dtype)


def start_gather_rows(row: torch.Tensor, group: AxisGroup):
    """Begin gathering every rank's equal 1-D ``row``; returns ``finish()``, which waits and returns the rows
    stacked in axis order (one row per coordinate). Lets sharded parameters be fetched while compute goes on."""
    if group.size == 1:
        return lambda: row.view(1, -1).clone()
    started = call.start_all_gather(_on_wire(row).contiguous(), group)

    def finish() -> torch.Tensor:
        rows = _off_wire(started(), row.dtype).view(group.size, -1)
        return rows if group.in_rank_order else rows[_from_group_order(group, list(range(group.size)))]

    return finish


def start_reduce_scatter_parts(parts: list[list[torch.Tensor]], op: str, group: AxisGroup):
    """Begin reducing several tensors over the group with ``op``, each given cut into the parts the axis
    coordinates keep (uneven ones included): ``parts[i][k]`` is what coordinate ``k`` keeps of tensor ``i``.
    Returns ``finish()``, which waits and returns this rank's reduced part of each tensor (shaped as
    ``parts[i][group.index]``). One reduce-scatter of one buffer: coordinate ``k``'s row holds its parts of every
    tensor end to end, padded to the longest row; the padding reaches nobody. Lets gradient buckets be reduced
    while backward goes on."""
    rows = parts[0][0].new_zeros((group.size, max(sum(t[k].numel() for t in parts) for k in range(group.size))))
    for k, row in enumerate(rows):
        offset = 0
        for t in parts:  # each part straight into its slot (a transposed gradient is copied once)
            row[offset : offset + t[k].numel()].view(t[k].shape).copy_(t[k])
            offset += t[k].numel()
    shapes, dtype = [t[group.index].shape for t in parts], rows.dtype
    if group.size == 1:
        started = lambda: rows[0].clone()  # noqa: E731 - one part is the whole: nothing to exchange
    else:
        _refuse_unreducible("reduce_scatter", rows, [op])
        send = rows if group.in_rank_order else rows[list(_to_group_order(group, range(group.size)))]
        started = call.start_reduce_scatter(_on_wire(send).contiguous().view(-1), op, group)

    def finish() -> list[torch.Tensor]:
        mine, offset, out = _off_wire(started(), dtype), 0, []
        for shape in shapes:
            out.append(mine[offset : offset + math.prod(shape)].view(shape))
            offset += math.prod(shape)
        return out

    return finish
