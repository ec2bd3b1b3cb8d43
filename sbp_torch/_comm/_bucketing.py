"""Collectives of a traced program merged into buckets: one all-reduce (or reduce-scatter) of a flat buffer where
the program issues several on one group, with one reduction and dtype, whose results nothing reads in between.

A whole step traced by ``compile_step`` reduces each parameter's gradient where it is complete, one collective per
use; on a link where every message pays a round trip (gloo, a network) those round trips are most of what the
reduction costs. Eagerly the gradient reducer buckets them; a traced program holds them one by one, and the
``eager`` and ``aot_eager`` backends run no pass that merges them.

Which collectives merge is decided by the graph's structure alone, never by sizes: a collective joins the open
bucket of its kind, group, reduction and dtype when it comes before the first read of any result in that bucket,
and nothing wrote into the bucket's inputs since its first member (a write closes the bucket).
Ranks whose parts differ in size (uneven splits) then merge alike, and the merged collectives keep the order the
graph gives them on every rank. The bucket runs where its last member ran, so every input exists by then, and
each member's result is a view of the reduced buffer, read only after it."""

from __future__ import annotations

import math
import operator

import torch
from torch.fx import GraphModule, Node

_OPS = torch.ops._c10d_functional
_MERGED = {_OPS.all_reduce.default, _OPS.reduce_scatter_tensor.default}


def _static(node: Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and all(isinstance(s, int) for s in value.shape)


def _wait_of(node: Node) -> Node | None:
    users = list(node.users)
    if len(users) == 1 and users[0].target is _OPS.wait_tensor.default and _static(users[0]):
        return users[0]
    return None


def _base(node):
    """The node whose storage ``node`` views (itself where it is no view)."""
    while isinstance(node, Node) and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view:
        node = node.args[0]
    return node


def _written(node: Node) -> set:
    """The storages (as ``_base`` nodes) an in-place op writes into."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
        return set()
    written = set()
    for argument, value in zip(target._schema.arguments, node.args):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written.add(_base(value))
    for name, value in node.kwargs.items():
        argument = next((a for a in target._schema.arguments if a.name == name), None)
        if argument is not None and argument.alias_info is not None and argument.alias_info.is_write:
            written.add(_base(value))
    return written


def _key(node: Node) -> tuple:
    """What must agree for two collectives to share one: op, its arguments but the tensor (reduction, group
    size, group name), dtype."""
    return (node.target, *node.args[1:], node.args[0].meta["val"].dtype)


class _Bucket:
    """Collectives to merge: ``members`` (collective, wait); ``deadline``, the first read of a result that cannot
    wait; ``inputs``, their inputs' storages; ``sunk``, the accumulations of results into a graph input that move
    after the bucket (``holders``: those inputs)."""

    def __init__(self):
        self.members: list[tuple[Node, Node]] = []
        self.deadline = math.inf
        self.inputs: set = set()
        self.sunk: list[Node] = []
        self.holders: set = set()

    def touched_by(self, node: Node) -> bool:
        """Whether ``node`` reads what a sunk accumulation writes, or its result: it must see them done."""
        if node in self.sunk:
            return False
        return any(a in self.sunk or _base(a) in self.holders for a in node.all_input_nodes)


def _accumulation(user: Node) -> Node | None:
    """The graph input an in-place accumulation (``grad.add_(reduced)``) writes into, or None for another node."""
    written = _written(user)
    holder = next(iter(written)) if len(written) == 1 else None
    if isinstance(holder, Node) and holder.op == "placeholder" and _base(user.args[0]) is holder:
        return holder
    return None


def _sinkable(user: Node) -> list[Node] | None:
    """The nodes that may run later with ``user``: an accumulation of a result into a graph input, or views of the
    result that only such accumulations read (a reduce-scatter's padding cut off); None where ``user`` may not."""
    if _accumulation(user) is not None:
        return [user]
    if not (isinstance(user.target, torch._ops.OpOverload) and user.target.is_view and user.users):
        return None
    chain = [user]
    for later in user.users:
        rest = _sinkable(later)
        if rest is None:
            return None
        chain += rest
    return chain


def bucket_collectives(gm: GraphModule) -> int:
    """Merge ``gm``'s all-reduces and reduce-scatters into buckets, in place; returns how many collectives it
    removed (0: the graph is unchanged)."""
    nodes = list(gm.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    open_buckets: dict[tuple, _Bucket] = {}
    closed: list[_Bucket] = []
    for node in nodes:
        written = _written(node)
        for key in [k for k, b in open_buckets.items() if b.inputs & written or b.touched_by(node)]:
            closed.append(open_buckets.pop(key))
        if node.op != "call_function" or node.target not in _MERGED or not _static(node.args[0]):
            continue
        wait = _wait_of(node)
        if wait is None:
            continue
        chains = {user: _sinkable(user) for user in wait.users}
        sunk = [n for chain in chains.values() if chain for n in chain]
        first_read = min((position[u] for u, chain in chains.items() if chain is None), default=math.inf)
        key = _key(node)
        bucket = open_buckets.get(key)
        if bucket is None or position[node] > bucket.deadline:
            if bucket is not None:
                closed.append(bucket)
            bucket = open_buckets[key] = _Bucket()
        bucket.members.append((node, wait))
        bucket.deadline = min(bucket.deadline, first_read)
        bucket.inputs.add(_base(node.args[0]))
        bucket.sunk += sunk
        bucket.holders |= {_accumulation(n) for n in sunk} - {None}
    closed += open_buckets.values()
    removed = 0
    for bucket in closed:
        if len(bucket.members) > 1:
            last = position[bucket.members[-1][0]]
            _merge(gm, bucket.members, sorted((n for n in bucket.sunk if position[n] < last), key=position.get))
            removed += len(bucket.members) - 1
    if removed:
        gm.graph.lint()
        gm.recompile()
    return removed


def _merge(gm: GraphModule, members: list[tuple[Node, Node]], moved: list[Node]) -> None:
    """One collective for ``members`` where the last ran; ``moved`` (accumulations of their results that came
    before it) after it, in their order."""
    graph = gm.graph
    last, _ = members[-1]
    first = members[0][0]
    aten = torch.ops.aten
    fake_mode = first.args[0].meta["val"].fake_mode
    scatter = first.target is _OPS.reduce_scatter_tensor.default
    rows = first.args[2] if scatter else 1  # a reduce-scatter's input: one row per rank of the group

    def call(target, args, value):
        new = graph.call_function(target, args)
        new.meta["val"] = value
        return new

    with graph.inserting_before(last), fake_mode:
        pieces, sizes = [], []
        for collective, _ in members:
            source = collective.args[0]
            value = source.meta["val"]
            shape = [rows, value.numel() // rows]
            pieces.append(call(aten.reshape.default, (source, shape), value.reshape(shape)))
            sizes.append(shape[1])
        values = [p.meta["val"] for p in pieces]
        flat_value = torch.cat(values, dim=1)
        flat = call(aten.cat.default, (pieces, 1), flat_value)
        if scatter:
            reduced_value = _OPS.reduce_scatter_tensor.default(flat_value, *first.args[1:])
        else:
            reduced_value = _OPS.all_reduce.default(flat_value, *first.args[1:])
        reduced = call(first.target, (flat, *first.args[1:]), reduced_value)
        waited_value = _OPS.wait_tensor.default(reduced_value)
        waited = call(_OPS.wait_tensor.default, (reduced,), waited_value)
        parts_value = torch.split(waited_value, sizes, dim=1)
        parts = call(aten.split_with_sizes.default, (waited, sizes, 1), list(parts_value))
        for index, (_, wait) in enumerate(members):
            part = call(operator.getitem, (parts, index), parts_value[index])
            shape = list(wait.meta["val"].shape)
            result = call(aten.view.default, (part, shape), parts_value[index].view(shape))
            wait.replace_all_uses_with(result)
    for user in moved:
        last.prepend(user)
    for collective, wait in members:
        graph.erase_node(wait)
        graph.erase_node(collective)
