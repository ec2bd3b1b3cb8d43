"""Pipeline parallelism: stages on their own placements, run by an actor runtime whose schedules emerge
from register quotas (``Pipeline``, ``SCHEDULES``, ``PipelineError``; see docs/pipeline.md)."""

from ._pipeline import SCHEDULES, Pipeline, PipelineError
