"""The public API's implementation: ``to_global``, the creation functions, ``Module.to_global``, the
caches' controls and DTensor interop. ``sbp_torch/__init__.py`` lists what users may rely on."""

from ._caches import Caches, cache_clear, cache_info, set_cache_size
from ._compile_step import CompiledStep, StepNotTraceable, compile_step
from ._dtensor import from_dtensor, module_from_dtensor, module_to_dtensor, to_dtensor
from ._explain import Collective, Explanation, explain
from ._factories import arange, empty, full, ones, rand, randn, tensor, zeros
from ._global_mode import global_mode
from ._local_map import local_map
from ._memory import MemoryReport, memory_report
from ._module import module_to_global
from ._sharding import MixedPrecision
from ._step_graph import GraphNotRecorded
from ._to_global import to_global
from ._world import init_process_group
