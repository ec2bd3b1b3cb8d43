"""Planning: the layout of a model's training step, found before anything runs (docs/planning.md).

``plan(model, batch, world)`` returns a ``Plan``; ``model.to_global(plan)`` applies it and ``plan.layout``
lays out a batch. ``CostModel`` holds a machine's constants (``H100``, ``A100``, ``CPU_GLOO``, or measured by
``calibrate()``)."""

from ._calibrate import calibrate
from ._cost_model import A100, CPU_GLOO, H100, CostModel, Link
from ._known_values import ValueReadInPlanning
from ._plan import Plan, Prediction
from ._predict import predict
from ._search import PlanError, plan

__all__ = [
    "A100",
    "CPU_GLOO",
    "CostModel",
    "H100",
    "Link",
    "Plan",
    "PlanError",
    "Prediction",
    "ValueReadInPlanning",
    "calibrate",
    "plan",
    "predict",
]
