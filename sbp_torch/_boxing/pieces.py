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
    for rank, need, term in receivers:
        for held, ranks in held_by.items():
            common = intersection(held[0], need) if term is None or held[1] == term else None
            if common is None:
                continue
            if rank in ranks:
                sender = rank
            else:
                sender = ranks[turns[held] % len(ranks)]
                turns[held] += 1
            pieces.append(Piece(sender, rank, *common))
    return tuple(pieces)


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
