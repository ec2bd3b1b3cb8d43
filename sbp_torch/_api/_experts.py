"""Mixture-of-experts layers run as their layout says: routing stays on the rank of its tokens, and experts split
over a placement axis receive the tokens routed to them (expert parallelism).

An experts module computes, for each token row, the routing-weighted sum of the outputs of the experts the router
picked for it; each row depends on its own row only, and each expert on its own slice (dim 0) of every parameter.
``EXPERT_MODULES`` lists the modules known to keep that contract. ``Module.to_global`` makes each such module's
forward a ``local_map`` region whose layouts follow, per placement axis, from its parameters and its tokens:

* parameters broadcast: each rank runs the module's own forward on its tokens (data parallelism: routing,
  sorting and the grouped matmuls all stay local, and the gradients are partial sums, reduced like any other);
* parameters split(0) (the expert dim) and tokens split(0): each token row goes to the rank holding its expert in
  one all-to-all, the expert computes there, and the result comes back in another (the backward does the same in
  reverse). The counts come from the routing, in one small all-to-all of per-expert counts before;
* parameters split(0) and tokens broadcast: each rank computes its own experts' share for every token; the output
  is partial(sum) on that axis.

Tokens split otherwise (along the hidden dim) or partial are made broadcast first; a second axis of split
experts with split tokens gathers its tokens (the all-to-all runs on one axis). A module whose parameters are laid
out in another way (an expert's weight split along a feature dim) is left alone: its ops then run through the
signature table, which is exact but gathers."""

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .. import _comm as comm
from .._layout import Broadcast, GlobalMeta, Placement, Split, broadcast, partial_sum
from .._tensor import GlobalTensor
from ._local_map import global_slots, run_locally, zero_reaching
from ._plain_units import keeps_dispatching, on_parts, opaque


@dataclass(frozen=True)
class ExpertsKind:
    """A kind of experts module: ``matches(module)`` says whether a module is one; its forward takes
    ``(hidden (tokens, width), top_k_index (tokens, k) integer, top_k_weights (tokens, k))`` and returns
    ``(tokens, width)``; the attribute ``count`` holds its number of experts, which every parameter's dim 0 has."""

    name: str
    matches: Callable[[nn.Module], bool]
    count: str


EXPERT_MODULES = [
    ExpertsKind(
        "transformers experts (classes decorated by use_experts_implementation: Mixtral, Qwen2/3-MoE, DeepSeek, ...)",
        lambda m: hasattr(m, "_is_expert_parallel") and hasattr(type(m), "_apply_gate") and hasattr(m, "num_experts"),
        "num_experts",
    ),
]


def install_expert_regions(model: nn.Module) -> None:
    """Make the forward of every experts module of ``model`` (``EXPERT_MODULES``) its region, once."""
    for module in model.modules():
        kind = next((k for k in EXPERT_MODULES if k.matches(module)), None)
        if kind is not None and not isinstance(module.forward, ExpertsRegion):
            module.forward = ExpertsRegion(module, kind)


@contextlib.contextmanager
def expert_regions(model: nn.Module):
    """Within the block, the experts modules of ``model`` run as their regions, as once laid out (the planner's
    trace prices them so); afterwards each module's forward is what it was."""
    before = {module: module.__dict__.get("forward") for module in model.modules()}
    install_expert_regions(model)
    try:
        yield
    finally:
        for module, forward in before.items():
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward


class ExpertsRegion:
    """The forward of one experts module: its layouts are decided on each call, from its parameters' current
    layouts (a sharded model gathers them per call) and its tokens'."""

    def __init__(self, module: nn.Module, kind: ExpertsKind):
        self.module, self.kind, self.original = module, kind, module.forward

    @comm.naming_cause(lambda *_: _cause("exchange"))
    def __call__(self, hidden, top_k_index, top_k_weights):
        slots = global_slots(self.module)
        if not isinstance(hidden, GlobalTensor) or not slots:
            if on_parts():  # inside a plain unit: this region's data-parallel case, on the parts
                return self._on_parts(hidden, top_k_index, top_k_weights)
            return self.original(hidden, top_k_index, top_k_weights)
        roles = _roles(self.module, self.kind, slots, hidden.placement)
        if roles is None:  # laid out in a way this does not cover: the ops decide, exactly
            return self.original(hidden, top_k_index, top_k_weights)
        if "expert" in roles:  # (a plain run of the unit around it would run its own forward on a slice of experts)
            keeps_dispatching(f"{type(self.module).__name__}'s experts are split over a placement axis")
        p = hidden.placement
        tokens = _token_sbp(hidden, roles)
        exchange = next((a for a, r in enumerate(roles) if r == "expert" and isinstance(tokens[a], Split)), None)
        out = tuple(partial_sum if r == "expert" and a != exchange else tokens[a] for a, r in enumerate(roles))
        held = _held(slots[0][2]._meta, exchange)
        body = functools.partial(
            self._body, held=held, group=None if exchange is None else comm.axis_group(p, exchange)
        )
        what = f"{type(self.module).__name__} (experts)"
        return run_locally(body, p, (hidden, top_k_index, top_k_weights), (tokens, tokens, tokens), [out],
                           out_shapes=[tuple(hidden.shape)], slots=slots, what=what)  # fmt: skip

    def _on_parts(self, hidden, top_k_index, top_k_weights):
        """The module's own forward on plain parts, reaching every parameter (and input) that needs a gradient, as
        the region does: which experts a rank's tokens reach differs between ranks, the gradients reduced must not."""
        with opaque():
            out = self.original(hidden, top_k_index, top_k_weights)
            needing = [t for t in (hidden, top_k_weights, *self.module.parameters()) if t.requires_grad]
            if needing and torch.is_grad_enabled():
                out = out + zero_reaching(needing).to(out.dtype)
        return out

    def _experts(self, rows: torch.Tensor, expert: torch.Tensor, count: int) -> torch.Tensor:
        """The module's own forward on ``rows``, each for its one (local) ``expert``, weight 1, with ``count``
        experts held here."""
        # Every rank's graph reaches the rows (so the exchange's backward runs on every rank) and every weight,
        # whatever arrived: eager code starts from zeros and skips the experts that received nothing.
        zero = zero_reaching([rows, *(t for t in self.module.parameters() if t.requires_grad)]).to(rows.dtype)
        if count == 0:  # no expert here: nothing arrives
            return rows * 0 + zero
        kept = getattr(self.module, self.kind.count)
        setattr(self.module, self.kind.count, count)
        try:
            ones = rows.new_ones(rows.shape[0], 1)
            return self.original(rows, expert.unsqueeze(-1), ones) + zero
        finally:
            setattr(self.module, self.kind.count, kept)

    def _body(self, hidden, top_k_index, top_k_weights, *, held: "_Held", group):
        if comm.estimating():  # explain, the planner: routing has no values; the exchanges are data-dependent
            if group is not None:  # (each (token, choice) row is sent: the cost rule counts this rank's share)
                rows = hidden.shape[0] * top_k_index.shape[-1]
                even = comm.DataDependent(rows * hidden.shape[-1] * hidden.element_size())
                _note_exchanges(group, held, even)
                hidden = _NotedInBackward.apply(hidden, group, even)
            return hidden * 0
        if group is None and held.everything:
            return self.original(hidden, top_k_index, top_k_weights)
        k = top_k_index.shape[-1]
        expert = top_k_index.reshape(-1)
        table = held.tables(hidden.device)
        dest, start = table.dest[expert], table.start[expert]
        key = torch.where(dest >= 0, dest * held.most + expert - start, held.slots)
        order = torch.argsort(key, stable=True)
        # (a count per slot by index_add, of a size known without the data: bincount's is data-dependent)
        counts = key.new_zeros(held.slots + 1).index_add_(0, key, torch.ones_like(key))
        counts = counts[: held.slots].view(held.members, held.most)
        if group is None:  # only this rank's experts, for every token
            sent = counts.sum().item()  # (traced: a symbol of the program, as the counts below)
            rows = order[:sent]
            out = self._experts(hidden[rows // k], expert[rows] - start[rows], held.count)
            return _combined(out, rows, k, top_k_weights, hidden)
        with comm.caused_by(_cause(_COUNTS)):
            received = comm.all_to_all(counts, 0, 0, [1] * group.size, [1] * group.size, group)
        # The one read of the routing. Traced, the counts are symbols of the program (sizes known when it runs).
        send, recv = torch.stack([counts.sum(1), received.sum(1)]).tolist()
        rows = order[: sum(send)]
        arrived = _Exchange.apply(hidden[rows // k], send, recv, group, _DISPATCH)
        local = torch.arange(held.most, device=hidden.device).repeat(group.size)
        experts = torch.repeat_interleave(local, received.reshape(-1), output_size=arrived.shape[0])
        out = self._experts(arrived, experts, held.count)
        return _combined(_Exchange.apply(out, recv, send, group, _COMBINE), rows, k, top_k_weights, hidden)


def _combined(out, rows, k, top_k_weights, hidden) -> torch.Tensor:
    """Each token's routing-weighted sum of the expert outputs ``out`` of its (token, choice) ``rows``."""
    weighted = out * top_k_weights.reshape(-1)[rows].unsqueeze(-1).to(out.dtype)
    return torch.zeros_like(hidden).index_add(0, rows // k, weighted.to(hidden.dtype))


def _roles(module, kind, slots, placement: Placement) -> list[str] | None:
    """Per axis, "local" (parameters broadcast) or "expert" (split along the expert dim); None if neither holds
    for some axis, or a parameter does not have one row per expert."""
    count = getattr(module, kind.count)
    if any(t.dim() == 0 or t.shape[0] != count or t.placement != placement for _, _, t in slots):
        return None
    roles = []
    for axis in range(placement.ndim):
        found = {"local" if isinstance(t.sbp[axis], Broadcast) else t.sbp[axis] for _, _, t in slots}
        if found == {"local"}:
            roles.append("local")
        elif found == {Split(0)}:
            roles.append("expert")
        else:
            return None
    return roles


def _token_sbp(hidden: GlobalTensor, roles: list[str]) -> tuple:
    """Tokens split along rows where they are, broadcast elsewhere; rows split on one expert axis at most."""
    sbp, exchanging = [], False
    for s, role in zip(hidden.sbp, roles):
        rows = isinstance(s, Split) and s.dim == 0
        if rows and role == "expert":
            rows, exchanging = not exchanging, True
        sbp.append(Split(0) if rows else broadcast)
    return tuple(sbp)


@dataclass(frozen=True)
class _Tables:
    dest: torch.Tensor  # per expert: the exchange group index of its rank, -1 if no rank of the group holds it
    start: torch.Tensor  # per expert: the first expert its holder holds


@dataclass(frozen=True)
class _Held:
    """Which experts this rank and its exchange group hold: ``owners[e]`` is the group index holding expert e
    (always 0 without an exchange), -1 for one held elsewhere; ``starts[e]`` its holder's first expert."""

    owners: tuple[int, ...]
    starts: tuple[int, ...]
    count: int  # experts held here
    most: int  # experts held by the group member holding most
    members: int  # ranks of the exchange group (1 without an exchange)
    everything: bool

    @property
    def slots(self) -> int:
        return self.members * self.most

    def tables(self, device) -> _Tables:
        if comm.compiling():  # (made inside the traced program: a tensor cached from an eager call is not its own)
            return _tables.__wrapped__(self, device)
        return _tables(self, device)


@functools.lru_cache(maxsize=256)
def _tables(held: _Held, device) -> _Tables:
    return _Tables(torch.tensor(held.owners, device=device), torch.tensor(held.starts, device=device))


@functools.lru_cache(maxsize=256)
def _held(meta: GlobalMeta, exchange: int | None) -> _Held:
    """``_Held`` for a parameter laid out as ``meta`` (dim 0: experts), exchanging along axis ``exchange``."""
    coord = meta.placement.local_coord()
    members = [coord] if exchange is None else [
        coord[:exchange] + (i,) + coord[exchange + 1 :] for i in range(meta.placement.shape[exchange])
    ]  # fmt: skip
    owners, starts = [-1] * meta.shape[0], [0] * meta.shape[0]
    sizes = []
    for index, member in enumerate(members):
        start, length = meta.region(member)[0][0], meta.region(member)[1][0]
        sizes.append(length)
        for e in range(start, start + length):
            owners[e], starts[e] = index, start
    mine = sizes[members.index(coord)]
    everything = exchange is None and mine == meta.shape[0]
    return _Held(tuple(owners), tuple(starts), mine, max(sizes), len(members), everything)


# What each exchange carries, named as its cause (``explain``)
_COUNTS, _DISPATCH, _COMBINE = "per-expert counts", "token rows to their experts' ranks", "expert outputs back"


def _cause(label: str) -> str:
    return f"expert parallelism: {label}"


class _Exchange(torch.autograd.Function):
    """Rows to the ranks of ``group``: ``send[i]`` of them to group index i, ``recv[i]`` arriving from it, end to
    end in group order. Backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send: list[int], recv: list[int], group, label: str):
        ctx.send, ctx.recv, ctx.group, ctx.label = send, recv, group, label
        with comm.caused_by(_cause(label)):
            return comm.all_to_all(rows.contiguous(), 0, 0, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        back = _Exchange.apply(grad, ctx.recv, ctx.send, ctx.group, f"gradient of the {ctx.label}")
        return back, None, None, None, None


def _note_exchanges(group, held: _Held, even: comm.DataDependent) -> None:
    with comm.caused_by(_cause(_COUNTS)):
        comm.notify("all-to-all", group, lambda: held.slots * 8)
    for label in (_DISPATCH, _COMBINE):
        with comm.caused_by(_cause(label)):
            comm.notify("all-to-all", group, lambda: even)  # as many rows as the routing sends


class _NotedInBackward(torch.autograd.Function):
    """Lists the backward's two data-dependent all-to-alls (for ``explain``)."""

    @staticmethod
    def forward(ctx, x, group, even):
        ctx.group, ctx.even = group, even
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        for label in (f"gradient of the {_COMBINE}", f"gradient of the {_DISPATCH}"):
            with comm.caused_by(_cause(label)):
                comm.notify("all-to-all", ctx.group, lambda: ctx.even)
        return grad, None, None
