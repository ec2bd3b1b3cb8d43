"""The frontend: ``GlobalTensor.__torch_function__``, above autograd (getters, batched matmul, local calls)."""

from ._local_calls import LOCAL_CALLS
from ._torch_function import torch_function

__all__ = ["LOCAL_CALLS", "torch_function"]
