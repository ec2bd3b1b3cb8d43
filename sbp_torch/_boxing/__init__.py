"""Boxing: moving a global tensor between layouts. A plan is plain data (which 1-D transition of the boxing
table runs on which axis, or which pieces go point to point, with its bytes and cost), found by one search
(``plan_boxing``, ``plan_cross`` between placements) and run by one function (``run_plan``, ``run_cross``)."""

from .cross_placement import CrossPlan, cross_target, plan_cross, run_cross
from .pieces import Piece, box_of, cut, pieces_between
from .plan import POINT_TO_POINT, BoxingPlan, BoxingStep, axis_view, plan_boxing
from .run import box_local, run_plan
