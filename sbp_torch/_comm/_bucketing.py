"""Collectives of a traced program merged into buckets: one all-reduce (reduce-scatter, all-gather) of a flat buffer
where the program issues several on one group, with one reduction and dtype.

A whole step traced by ``compile_step`` reduces each parameter's gradient where it is complete, one collective per
use, and gathers each sharded parameter apart; on a link where every message pays a round trip (gloo, a network)
those round trips are most of what the traffic costs. Eagerly the gradient reducer and a sharded unit's gather
bucket them; a traced program holds them one by one, and the ``eager`` and ``aot_eager`` backends run no pass that
merges them.

Which collectives merge is decided by the graph's structure alone, never by sizes, so ranks whose parts differ in
size (uneven splits) merge alike:

* all-reduces and reduce-scatters: a collective joins the open bucket of its kind, group, reduction and dtype when
  what read the bucket's results so far can run after it instead (below), and nothing else wrote into the bucket's
  inputs since they were issued;
* all-gathers: those traced inside one ``issued_together`` block (a sharded unit's parameters, converted together)
  merge, on the same condition.

The merged collective runs where the bucket's last member ran, so every input exists by then. What read an earlier
member's result before that point moves after it, in its order: only ops without effects beyond their outputs
(no collective, no random draw) or in-place writes, none of which the last member needs, none of whose inputs
anything else in between writes, and none of whose writes anything else in between reads. Each member's result is
then a view of the merged buffer."""

from __future__ import annotations

import contextlib
import operator

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import get_proxy_mode

_OPS = torch.ops._c10d_functional
_MERGED = {_OPS.all_reduce.default, _OPS.reduce_scatter_tensor.default}
_GATHER = _OPS.all_gather_into_tensor.default
_TOGETHER = "sbp_torch_issued_together"  # node meta: the nodes traced inside one ``issued_together`` block


@contextlib.contextmanager
def issued_together():
    """While a program is traced whole (``make_fx``): the all-gathers traced inside are one bucket's, to be merged
    by ``bucket_collectives`` (a sharded unit's parameters, converted together). Elsewhere it does nothing."""
    mode = get_proxy_mode()
    if mode is None:
        yield
        return
    graph = mode.tracer.graph
    before = next(iter(reversed(graph.nodes)))
    yield
    token = object()
    node = before.next
    while node is not graph._root:
        node.meta[_TOGETHER] = token
        node = node.next


def _static(node: Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and all(isinstance(s, int) for s in value.shape)


def _wait_of(node: Node) -> Node | None:
    users = list(node.users)
    if len(users) == 1 and users[0].target is _OPS.wait_tensor.default and _static(users[0]):
        return users[0]
    return None


def _base(node):
    """The node whose storage ``node`` shares: through views, the pieces of a view that returns several
    (``split``), and in-place or ``out=`` ops, which return the tensor they wrote (itself where it shares none)."""
    while isinstance(node, Node):
        if node.target is operator.getitem:
            node = node.args[0]
            continue
        aliased = _aliased(node)
        if aliased is None:
            break
        node = aliased
    return node


def _arguments(node: Node) -> dict:
    """An op node's arguments by their schema names."""
    return dict(zip((a.name for a in node.target._schema.arguments), node.args)) | node.kwargs


def _aliased(node: Node):
    """The argument an op's first result shares storage with (by its schema's alias sets), or None."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not target._schema.returns:
        return None
    if target.is_view:  # (views of several results, ``split``, carry the alias on their list's elements)
        return node.args[0] if isinstance(node.args[0], Node) else None
    returned = target._schema.returns[0].alias_info
    if returned is None:
        return None
    given = _arguments(node)
    for argument in target._schema.arguments:
        info = argument.alias_info
        if info is not None and info.before_set & returned.before_set and argument.name in given:
            value = given[argument.name]
            return value if isinstance(value, Node) else None
    return None


def _written(node: Node) -> set:
    """The storages (as ``_base`` nodes) an in-place op writes into, each tensor of a written list included
    (``_foreach_mul_``)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
        return set()
    given = _arguments(node)
    written = set()
    for argument in target._schema.arguments:
        if argument.alias_info is None or not argument.alias_info.is_write or argument.name not in given:
            continue
        value = given[argument.name]
        written |= {_base(v) for v in value} if isinstance(value, (list, tuple)) else {_base(value)}
    return written


def _movable(node: Node) -> bool:
    """Whether ``node`` may run later: an op whose only effects are its outputs and its in-place writes."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload) or target.namespace in ("_c10d_functional", "c10d"):
        return False
    return torch.Tag.nondeterministic_seeded not in target.tags


def _candidate(node: Node, kinds) -> Node | None:
    """The wait of a collective of ``kinds`` whose sizes the trace knows, or None."""
    if node.op != "call_function" or node.target not in kinds or not _static(node.args[0]):
        return None
    return _wait_of(node)


def _key(node: Node) -> tuple:
    """What must agree for two collectives to share one: op, its arguments but the tensor (reduction, group
    size, group name), dtype and device."""
    value = node.args[0].meta["val"]
    return (node.target, *node.args[1:], value.dtype, value.device)


def _ancestors(node: Node, since: int, position: dict) -> set:
    """The nodes at or after position ``since`` that ``node`` depends on."""
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        a = stack.pop()
        if a not in seen and position[a] >= since:
            seen.add(a)
            stack += a.all_input_nodes
    return seen


def _moved_after(members: list, until: Node, nodes: list, position: dict) -> list[Node] | None:
    """What must move after a merged collective placed at ``until`` (the last member): the nodes before it that read
    the members' results, transitively, in their order; None where the bucket cannot run there."""
    end = position[until]
    start = position[members[0][0]]
    readers, stack = set(), [wait for _, wait in members]
    while stack:
        for user in stack.pop().users:
            if position[user] < end and user not in readers:
                readers.add(user)
                stack.append(user)
    if not all(_movable(r) for r in readers):
        return None
    needed = set().union(*(_ancestors(c, start, position) for c, _ in members))
    if readers & needed:
        return None
    inputs: dict = {}  # each input's storage -> where it is first reduced
    for collective, _ in members:
        inputs.setdefault(_base(collective.args[0]), position[collective])
    writes = set().union(*(_written(r) for r in readers))
    reads = {_base(a) for r in readers for a in r.all_input_nodes}
    for node in nodes[start : end + 1]:  # (the last member too: it reads its input after the readers have moved)
        if node in readers:
            continue
        written = _written(node)
        if any(position[node] > inputs.get(b, end) for b in written):  # (a member would reduce the written value)
            return None
        if written & reads or (writes and any(_base(a) in writes for a in node.all_input_nodes)):
            return None
    return sorted(readers, key=position.get)


def bucket_collectives(gm: GraphModule) -> int:
    """Merge ``gm``'s all-reduces and reduce-scatters into buckets, and the all-gathers of each ``issued_together``
    block, in place; returns how many collectives it removed (0: the graph is unchanged)."""
    nodes = list(gm.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    buckets: list[tuple[list, list]] = []
    open_buckets: dict[tuple, tuple[list, list]] = {}  # key -> (members as (collective, wait), nodes to move)
    for node in nodes:
        wait = _candidate(node, _MERGED)
        if wait is None:
            continue
        key = _key(node)
        bucket = open_buckets.get(key)
        if bucket is not None:
            moved = _moved_after([*bucket[0], (node, wait)], node, nodes, position)
            if moved is not None:
                open_buckets[key] = ([*bucket[0], (node, wait)], moved)
                continue
            buckets.append(bucket)
        open_buckets[key] = ([(node, wait)], [])
    buckets += open_buckets.values()
    buckets += _gathers_issued_together(nodes, position)
    removed = 0
    # (by where each runs: a node that reads two buckets' results moves after the later one, last)
    for members, moved in sorted(buckets, key=lambda bucket: position[bucket[0][-1][0]]):
        if len(members) > 1:
            _merge(gm, members, moved)
            removed += len(members) - 1
    if removed:
        gm.graph.lint()
        gm.recompile()
    return removed


def _gathers_issued_together(nodes: list, position: dict) -> list[tuple[list, list]]:
    """Per ``issued_together`` block, the all-gathers of each group and dtype that may merge, and what moves."""
    blocks: dict = {}
    for node in nodes:
        token = node.meta.get(_TOGETHER)
        wait = _candidate(node, (_GATHER,)) if token is not None else None
        if wait is not None and wait.meta.get(_TOGETHER) is token:
            blocks.setdefault((token, _key(node)), []).append((node, wait))
    found = []
    for members in blocks.values():
        moved = _moved_after(members, members[-1][0], nodes, position) if len(members) > 1 else None
        if moved is not None:
            found.append((members, moved))
    return found


def _merge(gm: GraphModule, members: list[tuple[Node, Node]], moved: list[Node]) -> None:
    """One collective for ``members`` where the last ran; ``moved`` (what read their results before it) after it, in
    its order."""
    graph = gm.graph
    last, _ = members[-1]
    first = members[0][0]
    aten = torch.ops.aten
    fake_mode = first.args[0].meta["val"].fake_mode
    # a reduce-scatter's input holds one row per rank of the group, an all-gather's output does
    rows = first.args[2] if first.target is _OPS.reduce_scatter_tensor.default else 1

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
        flat_value = torch.cat([p.meta["val"] for p in pieces], dim=1)
        flat = call(aten.cat.default, (pieces, 1), flat_value)
        reduced_value = first.target(flat_value, *first.args[1:])
        reduced = call(first.target, (flat, *first.args[1:]), reduced_value)
        waited_value = _OPS.wait_tensor.default(reduced_value)
        waited = call(_OPS.wait_tensor.default, (reduced,), waited_value)
        parts_value = torch.split(waited_value, sizes, dim=1)
        parts = call(aten.split_with_sizes.default, (waited, sizes, 1), list(parts_value))
        for index, (_, wait) in enumerate(members):
            part = call(operator.getitem, (parts, index), parts_value[index])
            part_value = parts_value[index]
            if not part_value.is_contiguous():  # (an all-gather's rows: each rank's piece of every member)
                part_value = part_value.clone(memory_format=torch.contiguous_format)
                part = call(aten.clone.default, (part,), part_value)
            shape = list(wait.meta["val"].shape)
            result = call(aten.view.default, (part, shape), part_value.view(shape))
            wait.replace_all_uses_with(result)
    for node in moved:
        last.prepend(node)
    for collective, wait in members:
        graph.erase_node(wait)
        graph.erase_node(collective)
