"""The ``sbp_torch`` custom-op namespace and the reduction enum the ops share."""

NAMESPACE = "sbp_torch"
REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}  # torch's own reduction enum


def check_last_dim_param(name: str, x, param) -> None:
    """Refuse a per-feature parameter that is not 1-D of the last dim's size (the fused kernels assume it)."""
    if param.dim() != 1 or param.shape[0] != x.shape[-1]:
        raise ValueError(f"{name}: expected a 1-D parameter of size {x.shape[-1]}, got shape {tuple(param.shape)}")


def leading_dims(x) -> list[int]:
    """The dims a per-feature parameter's gradient is summed over."""
    return list(range(x.dim() - 1))
