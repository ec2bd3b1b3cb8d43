"""``explain``: the collectives a step on global tensors will issue, found without moving any data.

The step runs once on fake local parts (``FakeTensorMode``: shapes and dtypes, no values), with every
collective issued as the functional op a compiled program would hold, so nothing is sent. Each collective is
reported with the op and signature, or the conversion, that needed it: the nearest of the frames in
``CAUSES`` on the stack when it was issued."""

import collections
import sys
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


def _signature(decision) -> str:
    inputs = ", ".join("".join(map(repr, sbp)) for sbp in decision.input_sbps)
    outputs = ", ".join("".join(map(repr, meta.sbp)) for meta in decision.outputs)
    return f"({inputs}) -> ({outputs})"


# (file under sbp_torch/, function, the cause from the frame's locals): the first of these frames found going
# up the stack from the collective names its cause.
CAUSES = [
    ("_dispatch/_call_plan.py", "_run", lambda f: f"{f['func']} as {_signature(f['plan'].decision)}"),
    ("_dispatch/_fallback.py", "run_fallback", lambda f: f"{f['func']} on gathered inputs ({f['why']})"),
    ("_api/_gradient_reducer.py", None, lambda f: "gradient reduction (Module.to_global)"),
    ("_api/_experts.py", None, lambda f: f"expert parallelism: {f.get('label', 'exchange')}"),
    ("_tensor/_conversions.py", "forward", lambda f: "to_global to another layout"),
    ("_tensor/_conversions.py", "backward", lambda f: "gradient of to_global"),
    ("_api/_to_global.py", None, lambda f: "to_global of local parts"),
    ("_tensor/_global_tensor.py", None, lambda f: "full_tensor / to_local"),
    ("_dispatch/_dispatcher.py", "dispatch", lambda f: str(f["func"])),
]


def _cause() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path, name = frame.f_code.co_filename.replace("\\", "/"), frame.f_code.co_name
        for file, function, describe in CAUSES:
            if path.endswith("sbp_torch/" + file) and function in (None, name):
                return describe(frame.f_locals)
        frame = frame.f_back
    return "boxing"


def recorder(found: list, phase: dict):
    """The ``comm.observing`` callback that appends each collective to ``found`` as a ``Collective``, marked as
    backward while ``phase["backward"]``."""

    def note(kind, group, nbytes):
        found.append(Collective(kind, tuple(group.ranks), nbytes, _cause(), phase["backward"]))

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
