"""Pieces: the boxes of a logical tensor that ranks give each other to change its layout point to point.

A layout gives each rank a box of the logical tensor (or of one partial term of it). Moving to another layout
is a set of pieces: the intersections of the boxes held with the boxes needed. A rank that holds what it needs
copies it locally; otherwise one of the holders sends it, the holders taking turns. Used across placements
(``cross_placement.py``) and by the planner where pieces beat collectives (``plan.py``: ``(S0, B) -> (B, S0)``)."""

import math
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import _comm as comm
from .._layout import GlobalMeta, Partial, narrow_to, reduction_identity

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (starts, lengths) per tensor dim


@dataclass(frozen=True)
class Piece:
    """A box of the logical tensor that rank ``src`` gives rank ``dst`` (a local copy when they are equal)."""

    src: int
    dst: int
    starts: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def is_local(self) -> bool:
        return self.src == self.dst

    def __repr__(self) -> str:
        box = ", ".join(f"{s}:{s + n}" for s, n in zip(self.starts, self.lengths))
        how = "local copy" if self.is_local else "send"
        return f"rank {self.src} -> rank {self.dst}: [{box}] by {how}"


def box_of(meta: GlobalMeta, coord: tuple[int, ...]) -> Box:
    starts, lengths = meta.region(coord)
    return tuple(starts), tuple(lengths)


def intersection(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None when it holds no element (a plain loop: planners call it for
    every pair of boxes)."""
    starts, lengths = [], []
    for sa, na, sb, nb in zip(a[0], a[1], b[0], b[1]):
        start, end = max(sa, sb), min(sa + na, sb + nb)
        if end <= start:
            return None
        starts.append(start)
        lengths.append(end - start)
    return tuple(starts), tuple(lengths)


def fill_of(meta: GlobalMeta, coord: tuple[int, ...]):
    """What the part at ``coord`` of a target layout holds when it receives nothing: None when it receives the
    value (coordinate 0 on every partial axis), else the identity of the op of the *last* partial axis on
    which the coordinate is not 0. Why the last: partial axes nest like splits. Along the first such axis a
    the block at ``coord[a]`` must reduce to op_a's identity under the later axes; inside that block the
    coordinate 0 of the later axes holds it and every other part holds its own later axis' identity, recursively."""
    nonzero = [s for s, c in zip(meta.sbp, coord) if isinstance(s, Partial) and c != 0]
    return reduction_identity(nonzero[-1].op, meta.dtype) if nonzero else None


def holders(meta: GlobalMeta, boxes: dict | None = None) -> dict[tuple[Box, tuple[int, ...]], list[int]]:
    """Each (box, partial term) that the ranks of ``meta`` hold, with its holders in coordinate order. The term
    is the coordinates on the partial axes: ranks that differ only on broadcast axes hold the same thing.
    ``boxes`` (box by coordinate) replaces ``meta``'s own regions, for a layout that cuts them otherwise."""
    held: dict[tuple[Box, tuple[int, ...]], list[int]] = {}
    for c in meta.placement.coords():
        box = box_of(meta, c) if boxes is None else boxes[c]
        held.setdefault((box, partial_term(meta, c)), []).append(meta.placement.rank_at(c))
    return held


def partial_term(meta: GlobalMeta, coord: tuple[int, ...]) -> tuple[int, ...]:
    """The coordinates of ``coord`` on ``meta``'s partial axes: which term of the partial value it holds."""
    return tuple(c for s, c in zip(meta.sbp, coord) if isinstance(s, Partial))


def pieces_from(held_by: dict, receivers) -> tuple[Piece, ...]:
    """The pieces that give each receiver ``(rank, box it needs, term)`` its box from the ``held_by`` boxes (as
    ``holders`` gives them) of that partial term, or of every term when the term is None. A rank takes from
    itself what it holds; the other holders of one box take turns."""
    turns: Counter = Counter()  # remote sends served per held (box, term) so far
    pieces = []
    held = list(held_by.items())
    overlapping = Overlaps([box for (box, _), _ in held])
    for rank, need, term in receivers:
        for index in overlapping(need):  # (in ``held_by``'s order, as a plain loop over it would take them)
            key, ranks = held[index]
            if term is not None and key[1] != term:
                continue
            if rank in ranks:
                sender = rank
            else:
                sender = ranks[turns[key] % len(ranks)]
                turns[key] += 1
            pieces.append(Piece(sender, rank, *intersection(key[0], need)))
    return tuple(pieces)


class Overlaps:
    """The boxes of a list that share an element with a query box, as their indices in ascending order.

    Comparing every needed box with every held box takes time that grows with the square of the ranks (the
    planner prices placements of thousands). Two boxes overlap when their intervals overlap on every dim, and a
    layout's boxes take few distinct intervals per dim: so each dim's distinct intervals map to a bit mask of
    the boxes that have them, and a query ANDs, per dim, the masks of the intervals it overlaps."""

    def __init__(self, boxes: list[Box]):
        self.all = (1 << len(boxes)) - 1
        self.by_dim: list[dict[tuple[int, int], int]] = []
        for d in range(len(boxes[0][0]) if boxes else 0):
            masks: dict[tuple[int, int], int] = {}
            for i, (starts, lengths) in enumerate(boxes):
                interval = (starts[d], starts[d] + lengths[d])
                masks[interval] = masks.get(interval, 0) | (1 << i)
            self.by_dim.append(masks)
        self.memo: dict[tuple[int, int, int], int] = {}

    def _mask(self, d: int, start: int, end: int) -> int:
        key = (d, start, end)
        mask = self.memo.get(key)
        if mask is None:
            mask = 0
            for (s, e), bits in self.by_dim[d].items():
                if max(s, start) < min(e, end):
                    mask |= bits
            self.memo[key] = mask
        return mask

    def mask(self, need: Box) -> int:
        """The boxes that overlap ``need``, as a bit mask (bit ``i``: box ``i``)."""
        mask = self.all
        for d, (start, length) in enumerate(zip(*need)):
            mask &= self._mask(d, start, start + length)
            if not mask:
                break
        return mask

    def __call__(self, need: Box) -> list[int]:
        mask = self.mask(need)
        found = []
        while mask:
            low = mask & -mask
            found.append(low.bit_length() - 1)
            mask ^= low
        return found


def sends_between(src: GlobalMeta, dst: GlobalMeta) -> tuple[int, int]:
    """(elements sent, messages) of ``pieces_between(src, dst)``'s remote pieces, for layouts of one placement
    without partial axes, without building the pieces (there are up to the square of the ranks of them). Without partial
    axes the distinct boxes of ``src`` tile the tensor, so a receiver gets all it needs but what its own box
    holds, in one message per other box it overlaps."""
    held_by = holders(src)
    held = list(held_by)
    overlaps = Overlaps([box for box, _ in held])
    own = {}  # rank -> the index of the box it holds
    for index, ranks in enumerate(held_by.values()):
        own.update(dict.fromkeys(ranks, index))
    sent = messages = 0
    for c in dst.placement.coords():
        rank, need = dst.placement.rank_at(c), box_of(dst, c)
        mask = overlaps.mask(need)
        mine = own[rank]
        messages += mask.bit_count()
        sent += math.prod(need[1])
        if mask >> mine & 1:
            messages -= 1
            sent -= math.prod(intersection(held[mine][0], need)[1])
    return sent, messages


def pieces_between(src: GlobalMeta, dst: GlobalMeta) -> tuple[Piece, ...]:
    """The pieces that give every receiving rank of ``dst`` its box from the ranks of ``src`` (every term of a
    partial ``src``, to be combined)."""
    receivers = [
        (dst.placement.rank_at(c), box_of(dst, c), None) for c in dst.placement.coords() if fill_of(dst, c) is None
    ]
    return pieces_from(holders(src), receivers)


def cut(x: torch.Tensor, origin: tuple[int, ...], piece: Piece) -> torch.Tensor:
    """The view of ``x`` (a part whose box starts at ``origin``) that holds ``piece``."""
    return narrow_to(x, piece.starts, piece.lengths, origin)


def send_pieces(
    local: torch.Tensor, src_origin, pieces: tuple[Piece, ...], out: torch.Tensor, dst_origin, combine=None
) -> torch.Tensor:
    """Run ``pieces``: this rank's local copies into ``out`` and its sends from ``local`` (whose box starts at
    ``src_origin``), then its receives into ``out`` (whose box starts at ``dst_origin``). ``combine(old, new)``
    merges an arriving piece with what ``out`` holds (partial terms), else the piece is copied. Returns ``out``."""
    me = dist.get_rank()

    def place(piece: Piece, value: torch.Tensor) -> None:
        view = cut(out, dst_origin, piece)
        view.copy_(value if combine is None else combine(view, value))

    sends, arriving = [], []
    for tag, piece in enumerate(pieces):  # the piece's index tells pieces between one pair apart
        if piece.is_local and piece.dst == me:
            place(piece, cut(local, src_origin, piece))
        elif piece.src == me:
            sends.append((cut(local, src_origin, piece), piece.dst, tag))
        elif piece.dst == me:
            arriving.append((piece, tag))
    received, out = comm.send_recv(sends, [(p.lengths, p.src, tag) for p, tag in arriving], local, out)
    for (piece, _), value in zip(arriving, received):
        place(piece, value)
    return out
