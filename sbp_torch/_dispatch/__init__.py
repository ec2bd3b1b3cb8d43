"""Dispatch: how an aten op on global tensors runs (bind, cache, decide, plan, run, fallback, foreach,
in-place views). ``dispatch`` is the handler of ``GlobalTensor.__torch_dispatch__``."""

from ._bound import BoundCall, at, by_name, find_tensors, substitute
from ._cache import CacheInfo, LruCache
from ._dispatcher import CALLS, MixedTensorError, WriteIntoCopy, dispatch, recording
from ._modes import IMPLICIT_BROADCAST, implicit_broadcast, set_strict, strict
from ._native import NATIVE, PYTHON_CALLEES, native_local_calls, python_dispatch, torch_dispatch
