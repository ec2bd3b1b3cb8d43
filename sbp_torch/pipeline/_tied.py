"""Parameters tied across pipeline stages: one logical weight used by two stages on different placements.

Each stage holds its own copy, as Megatron-LM does for the embedding of its first and last stages. When the
pipeline is built, every copy takes the value of the first one named; after each step's backward, every copy's
gradient gains what the other copies accumulated during that step, so each holds the gradient the one shared
parameter would have had, and an optimizer that updates each parameter from its own value, gradient and state
(SGD, Adam, AdamW, ...) keeps the copies equal. Copies may differ in placement and SBP: moving values and
gradients between them is cross-placement boxing, which every rank runs. See docs/pipeline.md.
"""

import torch
import torch.distributed as dist
from torch import nn

from .._api import zeros
from .._tensor import GlobalTensor, gradient_sbp


def _holds(p: GlobalTensor) -> bool:
    return dist.get_rank() in p.placement


def _resolve(stages: list[nn.Module], name: str) -> tuple[int, nn.Parameter]:
    """``"<stage>.<parameter name>"`` -> (the stage index, that stage's parameter)."""
    index, _, rest = name.partition(".")
    if not index.isdigit() or int(index) >= len(stages) or not rest:
        raise ValueError(
            f"tied parameter {name!r}: expected '<stage index>.<parameter name>' with a stage index below {len(stages)}"
        )
    try:
        return int(index), stages[int(index)].get_parameter(rest)
    except AttributeError as err:
        raise ValueError(f"tied parameter {name!r}: stage {index} has no parameter {rest!r}") from err


class TiedParameters:
    """Groups of parameter copies on different stages that stay equal (see module docstring)."""

    def __init__(self, stages: list[nn.Module], groups):
        self.groups: list[list[nn.Parameter]] = []
        for group in groups:
            group = list(group)
            if len(group) < 2:
                raise ValueError(f"a tied group needs at least two parameters, got {group}")
            stage_of, params = zip(*(_resolve(stages, name) for name in group))
            first = params[0]
            for name, p in zip(group[1:], params[1:]):
                if (p.shape, p.dtype) != (first.shape, first.dtype):
                    raise ValueError(
                        f"tied parameters {group[0]!r} and {name!r} differ: {tuple(first.shape)} "
                        f"{first.dtype} against {tuple(p.shape)} {p.dtype}"
                    )
            if len(set(stage_of)) < len(stage_of):
                raise ValueError(
                    f"tied parameters {group} include two on one stage; tie those inside the stage's module instead"
                )
            self.groups.append(list(params))
        self._before: list[list] = []
        with torch.no_grad():  # every copy takes the first one's value
            for first, *copies in self.groups:
                for p in copies:
                    value = first.detach().to_global(p.placement, p.sbp)
                    if _holds(p):
                        p.copy_(value)

    def begin_step(self) -> None:
        """Remember the gradients the copies hold before the step (accumulated over earlier steps)."""
        self._before = [
            [p.grad.detach().clone() if _holds(p) and p.grad is not None else None for p in group]
            for group in self.groups
        ]

    def end_step(self) -> None:
        """Add to each copy's gradient what the other copies accumulated during the step. Every rank calls it."""
        for group, before in zip(self.groups, self._before):
            first = group[0]
            total = None
            for p, old in zip(group, before):
                step_grad = self._step_gradient(p, old).to_global(first.placement, gradient_sbp(first.sbp))
                total = step_grad if total is None else total + step_grad
            for p, old in zip(group, before):
                share = total.to_global(p.placement, gradient_sbp(p.sbp))
                if _holds(p):
                    p.grad = share if old is None else old + share
        self._before = []

    @staticmethod
    def _step_gradient(p: nn.Parameter, before) -> GlobalTensor:
        """What ``p`` accumulated during the step, laid out as ``gradient_sbp(p.sbp)`` (zeros where none)."""
        sbp = gradient_sbp(p.sbp)
        if not _holds(p) or p.grad is None:
            return zeros(*p.shape, placement=p.placement, sbp=sbp, dtype=p.dtype)
        grad = p.grad.detach()
        if grad.sbp != sbp:
            grad = grad.to_global(sbp=sbp)
        return grad if before is None else grad - before
