"""The ``sbp_torch`` custom-op namespace and what the ops share: the reduction enum, parameter checks, the sum
over rows that a per-feature parameter's gradient is."""

import torch

NAMESPACE = "sbp_torch"
REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}  # torch's own reduction enum


def check_last_dim_param(name: str, x, param) -> None:
    """Refuse a per-feature parameter that is not 1-D of the last dim's size (the fused kernels assume it)."""
    if param.dim() != 1 or param.shape[0] != x.shape[-1]:
        raise ValueError(f"{name}: expected a 1-D parameter of size {x.shape[-1]}, got shape {tuple(param.shape)}")


def sum_rows(t: torch.Tensor) -> torch.Tensor:
    """``t[..., H]`` summed over every dim but the last: a per-feature parameter's gradient (``[H]``, also for
    1-D ``t``, where ``t.sum([])`` would sum everything)."""
    return t.reshape(-1, t.shape[-1]).sum(0)


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics of a ``dtype`` tensor are computed and kept in: float32 for 16-bit floats."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def float_work(t: torch.Tensor) -> torch.Tensor:
    """``t`` in its statistics' dtype."""
    return t.to(stats_dtype(t.dtype))
