"""The frontend: ``GlobalTensor.__torch_function__``, above autograd (getters, batched matmul, local calls)."""

from ._local_calls import LOCAL_CALLS
from ._torch_function import python_handlers, torch_function
