"""``explain``: the collectives a step on global tensors will issue, found without moving any data.

The step runs once on fake local parts (``FakeTensorMode``: shapes and dtypes, no values), with every
collective issued as the functional op a compiled program would hold, so nothing is sent. Each collective is
reported with the op and signature, or the conversion, that needed it: the innermost cause named by the code
that issued it (``_comm.caused_by``, ``_comm.naming_cause``)."""

import collections
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from .. import _comm as comm
from .._tensor import GlobalTensor


@dataclass(frozen=True)
class Collective:
    """One collective a step issues on this rank."""

    kind: str  # "all-reduce(sum)", "all-gather", "reduce-scatter(sum)", "all-to-all", "broadcast", ...
    ranks: tuple[int, ...]  # the group it runs on, in placement-axis order
    bytes: int | None  # what this rank puts in; None: data-dependent (tokens routed to experts)
    cause: str  # the op and its signature, or the conversion, that needed it
    backward: bool  # issued by the backward pass
    even_estimate: int | None = None  # where data-dependent: the bytes if routing were even (what the planner prices)


class Explanation(list):
    """The collectives of one step, in the order this rank issues them."""

    def counts(self) -> dict[str, int]:
        """Kind -> how many."""
        return dict(collections.Counter(c.kind for c in self))

    def __str__(self) -> str:
        known = sum(c.bytes for c in self if c.bytes is not None)
        dependent = sum(c.bytes is None for c in self)
        lines = [f"{len(self)} collectives, {known} bytes from this rank"]
        if dependent:
            lines[0] += f" and {dependent} data-dependent all-to-alls"
        lines += [
            f"  {'backward' if c.backward else 'forward':8} {c.kind:22} ranks {list(c.ranks)!s:14} "
            f"{'data-dependent' if c.bytes is None else f'{c.bytes} B':>14}  {c.cause}"
            for c in self
        ]
        return "\n".join(lines)


def recorder(found: list, phase: dict):
    """The ``comm.observing`` callback that appends each collective to ``found`` as a ``Collective``, marked as
    backward while ``phase["backward"]``."""

    def note(kind, group, nbytes):
        even = nbytes.estimate if isinstance(nbytes, comm.DataDependent) else None
        nbytes = None if isinstance(nbytes, comm.DataDependent) else nbytes
        found.append(Collective(kind, tuple(group.ranks), nbytes, comm.cause(), phase["backward"], even))

    return note


def _graph_leaves(outputs) -> list[torch.Tensor]:
    """The tensors whose gradients backward from ``outputs`` accumulates."""
    seen, leaves, stack = set(), [], [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            leaves.append(node.variable)
        stack += [next_node for next_node, _ in node.next_functions]
    return leaves


def explain(fn, *args, backward: bool = True, **kwargs) -> Explanation:
    """The collectives that ``fn(*args, **kwargs)`` (and, when ``backward`` and its outputs require grad, the
    backward of their sum, as ``loss.backward()``) issues on this rank, found without sending anything.

    Every rank must call it, as it would call ``fn``: conversions of local parts still agree on their metadata.
    ``fn`` must not read values (``.item()``, Python control flow on data). Gradients the backward would leave
    in ``.grad`` are put back as they were."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    found = Explanation()
    phase = {"backward": False}  # (ours to say: gradient reduction runs after the last autograd node)

    def fake(a):
        if isinstance(a, GlobalTensor):
            return GlobalTensor(mode.from_tensor(a._local), a._meta, requires_grad=a.requires_grad)
        return mode.from_tensor(a) if isinstance(a, torch.Tensor) else a

    args, kwargs = tree_map(fake, (args, kwargs))
    with comm.observing(recorder(found, phase), estimate=True), mode:
        out = fn(*args, **kwargs)
        outputs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
        if backward and outputs:
            leaves = _graph_leaves(outputs)
            kept = [leaf.grad for leaf in leaves]
            phase["backward"] = True
            try:
                torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
            finally:
                for leaf, grad in zip(leaves, kept):
                    leaf.grad = grad
    return found
