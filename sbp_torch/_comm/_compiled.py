"""Ranks agree on what their compiled programs communicate, checked once per compilation.

Each rank compiles its own program with ``torch.compile``. A collective pairs the n-th call of each rank of its
group, so if the programs of two ranks differ in their collectives (kind, group, sizes, dtype, order), running
them would abort gloo ("Received data size doesn't match") or wait forever. So:

* every collective that AOTAutograd traces (forward and backward, in trace order) is recorded here, in the
  compilation that traces it (``record``); the backward compiled later, at the first backward call, was traced
  with the forward, so one record covers both;
* when Dynamo's compilation of a frame ends, the ranks that took part exchange their records, once, and each
  compares them group by group: the members of a group must issue the same sequence of collectives on it, with
  matching sizes. Every rank then raises the same ``RanksDisagree`` naming the first difference;
* metadata that ranks exchange while a program is traced (``to_global``'s parts) is exchanged once per
  compilation and reused by the later traces of the same call (``agree_while_compiling``).

Both exchanges go through the default group's key-value store, not a collective: a rank that compiles alone
(say a guard that failed on one rank only) must not meet the others' compiled collectives. A rank that waits
longer than the store's timeout for the others raises, and closes its process groups so that they raise too.
"""

import contextlib
import functools
import hashlib
import pickle
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch._guards import CompileContext
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.fx.experimental.symbolic_shapes import has_free_unbacked_symbols

from ._faults import close_world

# key-value store prefix; the store outlives a compiled program, so old keys are deleted as ranks move on
_PREFIX = "sbp_torch/compiled"


class RanksDisagree(RuntimeError):
    """The ranks compiled programs whose collectives differ, or one rank compiled where the others did not."""


class Traced(NamedTuple):
    """One collective as this rank's program issues it."""

    kind: str
    ranks: tuple[int, ...]  # its process group's ranks, sorted (torch's group order)
    dtype: str
    shape: tuple[int, ...]
    sends: tuple[int, ...] | None  # all-to-all: elements to each group rank, in group order
    receives: tuple[int, ...] | None

    def __str__(self) -> str:
        if self.sends is None:
            return f"{self.kind} of a {self.dtype} {self.shape}"
        return f"{self.kind} of {self.dtype} sending {list(self.sends)} and receiving {list(self.receives)} elements"


def compiling() -> bool:
    """Whether ``torch.compile`` traces the running code: Dynamo (``is_compiling``), or AOTAutograd and the
    backends under Dynamo's compilation (torch 2.11 holds ``is_compiling`` false there)."""
    return torch.compiler.is_compiling() or CompileContext.current_compile_id() is not None


class _Compilation:
    """What one compilation recorded: every collective traced (Dynamo's run included), those that AOTAutograd
    traced into the graphs, and the metadata agreed.

    While it runs (restored when it ends), what decides a compiled program's collectives after it is traced
    decides the same on every rank, whatever the sizes of their parts:

    * AOTAutograd's common-subexpression elimination is off: it would merge two collectives whose inputs are the same
      expression on one rank (a reduction over an empty part folded to a constant, identity parts made from nothing)
      but not on the others, which would then wait for a collective that never comes;
    * a partitioner decides what the backward saves and what it recomputes by the sizes of the values, which
      differ between ranks holding uneven parts, and may then put a collective in one rank's backward graph only.
      Where the ranks' joint graphs differ in shapes, ``_joint_pass`` marks every value to be saved, for any
      backend; Inductor's partition is checked after it runs (``_partitioner_type``).
    """

    def __init__(self):
        self.ranks: set[int] = set()  # the placements this compilation communicates on
        self.graphs: list[Traced] = []
        self.agreed: dict = {}
        self.shapes_alike = True  # whether the ranks' joint graphs have the same shapes (``_joint_pass``)
        functorch = torch._functorch.config
        self.cse, self.joint_pass = functorch.cse, functorch.joint_custom_pass
        functorch.cse, functorch.joint_custom_pass = False, _joint_pass
        inductor = _inductor_config()
        self.partitioner = inductor.custom_partitioner_fn
        inductor.custom_partitioner_fn = _same_on_every_rank(self.partitioner)

    def restore(self) -> None:
        functorch = torch._functorch.config
        functorch.cse, functorch.joint_custom_pass = self.cse, self.joint_pass
        _inductor_config().custom_partitioner_fn = self.partitioner


def _joint_pass(gm, joint_inputs):
    """AOTAutograd's pass over the joint forward and backward graph, before any backend partitions it: where
    the ranks' joint graphs differ in shapes, every value is marked to be saved rather than recomputed, so that a
    partitioner's choice no longer depends on sizes."""
    compilation = _compilation[0]
    if compilation is not None and compilation.joint_pass is not None:
        gm = compilation.joint_pass(gm, joint_inputs)
    ranks = tuple(sorted(compilation.ranks)) if compilation is not None else ()
    if len(ranks) < 2 or dist.get_rank() not in ranks:
        return gm
    shapes = _exchange("joint", ranks, _shapes_of(gm.graph), what="a compiled program's joint graph")
    compilation.shapes_alike = len(set(shapes)) == 1
    if not compilation.shapes_alike:
        from torch.utils.checkpoint import CheckpointPolicy

        for node in gm.graph.nodes:
            if node.op == "call_function" and "recompute" not in node.meta:
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return gm


# The running compilation's record: Dynamo compiles one frame at a time (under its compile lock), and a
# compilation's id may change while it runs (a restarted analysis counts as another attempt).
_compilation: list[_Compilation | None] = [None]
_sequence: dict[tuple, int] = {}  # (topic, ranks) -> how many exchanges this rank made


def _current() -> _Compilation:
    """The record of the running compilation; makes sure its end is reported to ``_on_compile_end``."""
    callbacks = _dynamo_callbacks()
    if _on_compile_end not in callbacks.end_callbacks:  # (``torch._dynamo.reset`` clears them)
        callbacks.register_end_callback(_on_compile_end)
    if _compilation[0] is None:
        _compilation[0] = _Compilation()
    return _compilation[0]


@functools.cache
def _inductor_config():
    import torch._inductor.config  # (imported once a program compiles)

    return torch._inductor.config


@functools.cache
def _partitioner_type():
    """Inductor's partitioner for a program with sbp_torch's collectives (a ``CustomPartitionerFn``).

    A partitioner decides what the backward saves and what it recomputes by the sizes of the values, which
    differ between ranks holding uneven parts, and drops a collective whose result its rank does not read. So:
    where the compilation's ranks traced joint graphs of the same shapes (``_joint_pass``), the partitioner it
    replaced (by default Inductor's min-cut) decides; where they differ, the default partition, which keeps
    forward and backward as traced. Either way the ranks then compare the collectives of their forward and
    backward graphs; where they differ, the default partition is tried, and where that differs too every rank
    raises ``RanksDisagree``: a program that would leave a rank waiting in a collective never runs."""
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
    from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files

    class SameOnEveryRank(CustomPartitionerFn):
        def __init__(self, replaced):
            self.replaced = replaced

        def __call__(self, gm, joint_inputs, **kwargs):
            compilation = _compilation[0]
            ranks = tuple(sorted(compilation.ranks)) if compilation is not None else ()
            if len(ranks) < 2 or dist.get_rank() not in ranks:
                return (self.replaced or min_cut_rematerialization_partition)(gm, joint_inputs, **kwargs)
            indices = kwargs.get("static_lifetime_input_indices")
            tries = [
                lambda g: default_partition(
                    g, joint_inputs, num_fwd_outputs=kwargs["num_fwd_outputs"], static_lifetime_input_indices=indices
                )
            ]
            if compilation.shapes_alike:
                tries.insert(
                    0, lambda g: (self.replaced or min_cut_rematerialization_partition)(g, joint_inputs, **kwargs)
                )
            for attempt, partition in enumerate(tries, 1):
                # (a partitioner may change the joint graph it is given: each try gets its own copy)
                graphs = tuple(_without_unused_collectives(g) for g in partition(_copied(gm)))
                prints = _exchange("partitioned", ranks, [_collectives_of(g) for g in graphs], what="a partition")
                problems = [first_difference(dict(zip(ranks, p))) for p in zip(*prints)]
                if not any(problems) or attempt == len(tries):
                    break
            for part, problem in zip(("forward", "backward"), problems):
                if problem is not None:
                    raise RanksDisagree(
                        f"the ranks' compiled {part} graphs issue different collectives after torch.compile's "
                        f"partitioner ran, so they cannot run: {problem}. Run this program eagerly, or lay out its "
                        "inputs so that no rank holds an empty part"
                    )
            return graphs

        def uuid(self):
            return get_hash_for_files((__file__,), repr(self.replaced and self.replaced.uuid()))

        def __reduce__(self):  # (Inductor pickles its configuration into cache keys)
            return _same_on_every_rank, (self.replaced,)

    return SameOnEveryRank


def _copied(gm):
    """A copy of the joint graph ``gm`` for one partitioner to change; the nodes' metadata is shared."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copy = torch.fx.GraphModule(gm, graph)
    copy.meta = dict(gm.meta)
    return copy


def _without_unused_collectives(gm):
    """``gm`` without the collectives whose results nothing uses (their waits included), and what fed only them:
    a partition leaves such dead copies where a value it saves for the backward was computed from them."""
    graph = gm.graph
    functional = torch.ops._c10d_functional
    removed = False
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node.users or node.target is not functional.wait_tensor.default:
            continue
        issued = node.args[0]
        graph.erase_node(node)
        removed = True
        if isinstance(issued, torch.fx.Node) and not issued.users:
            graph.erase_node(issued)
    if removed:
        graph.eliminate_dead_code(is_impure_node=_keeps)
        gm.recompile()
    return gm


def _keeps(node) -> bool:
    """Dead-code elimination after removing unused collectives keeps the other collectives and mutations."""
    return getattr(node.target, "namespace", None) == "_c10d_functional" or node.is_impure()


def holds_collectives(gm) -> bool:
    """Whether the traced program ``gm`` issues any collective."""
    return any(getattr(node.target, "namespace", None) in ("_c10d_functional", "c10d") for node in gm.graph.nodes)


def _collectives_of(gm) -> list[Traced]:
    """The collectives of a partitioned graph, in its order, in the form of the check of traced programs."""
    found = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or getattr(target, "namespace", None) != "_c10d_functional":
            continue
        name = target._schema.name.split("::")[1]
        if name == "wait_tensor":
            continue
        sent = node.args[0].meta.get("val")
        group = dist.distributed_c10d._resolve_process_group(node.args[-1])
        ranks = tuple(sorted(dist.get_process_group_ranks(group)))
        sends = receives = None
        if name == "all_to_all_single":
            receives, sends = (tuple(map(_size, counts)) for counts in node.args[1:3])
        found.append(Traced(name, ranks, str(sent.dtype), tuple(map(_size, sent.shape)), sends, receives))
    return found


def _same_on_every_rank(replaced):
    return _partitioner_type()(replaced)


def _shapes_of(graph) -> str:
    """A digest of what a partition decides by: each node's op and the shape of its value."""
    described = []
    for node in graph.nodes:
        value = node.meta.get("val")
        described.append(f"{node.op}:{node.target}:{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}")
    return hashlib.sha256("/".join(described).encode()).hexdigest()


@functools.cache
def _dynamo_callbacks():
    from torch._dynamo.callback import callback_handler  # (imported once a program compiles: Dynamo is loaded)

    return callback_handler


def record(kind: str, group, tensor: torch.Tensor, sends=None, receives=None) -> None:
    """Note the collective ``kind`` on the ``AxisGroup`` ``group`` that this rank's compiled program issues on
    ``tensor`` (what it puts in); nothing unless a compilation runs."""
    if CompileContext.current_compile_id() is None:
        return
    compilation = _current()
    placement = group.placement
    compilation.ranks.update(group.ranks if placement is None else placement.flat_ranks)
    if get_proxy_mode() is None:  # Dynamo's run on fake parts, or AOTAutograd's analysis: no graph is made
        return
    as_tuple = lambda counts: None if counts is None else tuple(map(_size, counts))  # noqa: E731
    shape = tuple(map(_size, tensor.shape))
    entry = Traced(kind, tuple(sorted(group.ranks)), str(tensor.dtype), shape, as_tuple(sends), as_tuple(receives))
    compilation.graphs.append(entry)


# A size known only when the program runs (rows routed to experts): an unbacked symbol of the trace
DATA_DEPENDENT = "data-dependent"


def _size(value) -> int | str:
    """A size or count of a traced collective as the ranks compare it: its number (a dynamic size's, which the
    program is guarded on), or ``DATA_DEPENDENT``."""
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
    return DATA_DEPENDENT if has_free_unbacked_symbols(value) else int(value)


def note_placement(placement) -> None:
    """Have the running compilation, if any, take part in the check with the ranks of ``placement``, which one of
    its global tensors lives on: a program on global tensors takes part even where it issues no collective."""
    if CompileContext.current_compile_id() is not None:
        _current().ranks.update(placement.flat_ranks)


def agree_while_compiling(key, value) -> list:
    """Every rank's ``value`` (rank order) for the call ``key`` of this rank's running compilation: exchanged over
    the world the first time, and the same answer for the later traces of the compilation (Dynamo's run, then
    AOTAutograd's). ``key`` holds all this rank's call depends on, so no other call reuses the answer."""
    compilation = _current()
    world = tuple(range(dist.get_world_size()))
    compilation.ranks.update(world)
    if key not in compilation.agreed:
        compilation.agreed[key] = _exchange("agree", world, value, what=f"{key[0]} inside a compiled program")
    return compilation.agreed[key]


@contextlib.contextmanager
def tracing_program():
    """Within the block, code is traced into a program outside ``torch.compile`` (``compile_step``): ``compiling()``
    holds (collectives are functional ops, metadata is agreed once through the store), and torch's own code takes
    its traceable paths (``torch.compiler.is_compiling()``: an optimizer reads no step count). The block's record
    of agreed metadata ends with it; the list it yields then holds what was agreed (the program depends on it)."""
    previous = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    depth = torch._C._len_torch_function_stack()
    agreed = []
    try:
        yield agreed
    finally:
        torch.compiler._is_compiling_flag = previous
        # A laid-out module whose forward raised while traced left its global mode entered (torch skips the
        # always-called forward hooks while compiling), and the tracer's own mode then popped it in its place:
        # modes left above the entry's are this trace's, and go with it.
        while torch._C._len_torch_function_stack() > depth:
            torch._C._pop_torch_function_stack()
        compilation, _compilation[0] = _compilation[0], None
        if compilation is not None:
            compilation.restore()
            agreed += compilation.agreed


def check_program(gm, what: str, failed: str | None = None) -> str | None:
    """Compare the collectives of the traced programs ``gm`` of the ranks of the world (kind, group, sizes, order)
    and raise ``RanksDisagree`` on every rank if they differ; ``what`` names the program in messages. A rank that
    could not trace its program passes ``failed`` (why) instead: then every rank returns the first such rank's
    reason, so that no rank waits for a program another will not run. None when all traced alike."""
    world = tuple(range(dist.get_world_size()))
    if len(world) < 2:
        return failed
    mine = ("failed", failed) if failed is not None else ("traced", _collectives_of(gm))
    prints = _exchange("program", world, mine, what=what)
    failures = {r: why for r, (state, why) in zip(world, prints) if state == "failed"}
    if failures:
        first = min(failures)
        return f"rank(s) {sorted(failures)} could not trace {what}; rank {first}: {failures[first]}"
    problem = first_difference({r: collectives for r, (_, collectives) in zip(world, prints)})
    if problem is not None:
        raise RanksDisagree(f"the ranks traced {what}s whose collectives differ, so they cannot run: {problem}")
    return None


def _on_compile_end(args) -> None:
    if args.callback_trigger.name != "DYNAMO":  # (a lazy backward was traced with its forward)
        return
    compilation, _compilation[0] = _compilation[0], None
    if compilation is None:
        return
    compilation.restore()
    if len(compilation.ranks) < 2 or dist.get_rank() not in compilation.ranks:
        return
    ranks = tuple(sorted(compilation.ranks))
    prints = _exchange("collectives", ranks, compilation.graphs, what="a compiled program")
    problem = first_difference(dict(zip(ranks, prints)))
    if problem is not None:
        # Dynamo runs this callback before it counts the compilation as ended, and does not count it if the
        # callback raises: count it here, or no later compilation would run its callbacks.
        handler, pending = _dynamo_callbacks(), "_CompilationCallbackHandler__pending_callbacks_counter"
        if getattr(handler, pending, None) == 1:
            setattr(handler, pending, 0)
        raise RanksDisagree(
            f"the ranks compiled programs whose collectives differ, so they cannot run: {problem}. Every rank "
            "must run the same program on layouts that agree; a program whose collectives depend on the rank's "
            "own values (its part's size, data) cannot be compiled"
        )


def gather_call_facts(what: str, value) -> list:
    """Every rank's ``value`` (in rank order) for the call ``what`` that every rank of the world makes now, through the
    store: what a compiled program's runtime must know of the others before it picks a program."""
    return _exchange("call", tuple(range(dist.get_world_size())), value, what)


def _exchange(topic: str, ranks: tuple[int, ...], value, what: str) -> list:
    """Every one of ``ranks``' ``value`` (in that order), through the default store; ``what`` for messages."""
    store = dist.distributed_c10d._get_default_store()
    me = dist.get_rank()
    counter = (topic, ranks)
    sequence = _sequence.get(counter, 0)
    _sequence[counter] = sequence + 1
    prefix = f"{_PREFIX}/{topic}/{'-'.join(map(str, ranks))}"
    keys = [f"{prefix}/{sequence}/{r}" for r in ranks]
    store.set(keys[ranks.index(me)], pickle.dumps(value))
    try:
        received = store.multi_get(keys)  # (it waits for the keys)
    except (RuntimeError, ValueError) as err:  # the store's timeout: some rank never came
        missing = "some"
        with contextlib.suppress(RuntimeError, ValueError):
            missing = [r for r, key in zip(ranks, keys) if not store.check([key])]
        error = RanksDisagree(
            f"{what}: rank(s) {missing} did not take part in the exchange of ranks {list(ranks)} (waited "
            f"{store.timeout}): every rank must make the same calls, and compile the same programs, in the same "
            "order. A rank that compiles alone ran a program in a layout or shape the others did not, or found it in "
            f"a compile cache the others did not have (this rank's exchange #{sequence} of {topic})"
        )
        close_world(str(error), error)
        raise error from err
    values = [pickle.loads(v) for v in received]
    if sequence:  # every rank has read the previous exchange, since every rank wrote this one
        with contextlib.suppress(RuntimeError, ValueError):
            store.delete_key(f"{prefix}/{sequence - 1}/{me}")
    return values


def first_difference(prints: dict[int, list[Traced]]) -> str | None:
    """The first collective on which the ranks' programs ``prints`` (rank -> its collectives in order) differ,
    described, or None."""
    by_group: dict[tuple[int, ...], dict[int, list]] = {}
    for rank, entries in prints.items():
        for index, entry in enumerate(entries):
            by_group.setdefault(entry.ranks, {}).setdefault(rank, []).append((index, entry))
    for ranks, issued in sorted(by_group.items()):
        members = [r for r in ranks if r in prints]
        for k in range(max(len(issued.get(r, ())) for r in members)):
            got = {r: issued[r][k] if k < len(issued.get(r, ())) else None for r in members}
            if _mismatch(ranks, {r: g and g[1] for r, g in got.items()}):
                lines = "; ".join(
                    f"rank {r} issues {'nothing more' if g is None else f'{g[1]} (its collective #{g[0]})'}"
                    for r, g in got.items()
                )
                return f"collective #{k} on the group of ranks {list(ranks)}: {lines}"
    return None


def _mismatch(ranks: tuple[int, ...], got: dict[int, Traced | None]) -> bool:
    entries = list(got.values())
    if any(e is None for e in entries):
        return True
    if len({(e.kind, e.dtype) for e in entries}) > 1:
        return True
    if entries[0].sends is None:
        return len({e.shape for e in entries}) > 1
    # an all-to-all: what each rank sends to another is what that one receives from it
    at = {r: ranks.index(r) for r in got}
    return any(got[a].sends[at[b]] != got[b].receives[at[a]] for a in got for b in got)
