"""Fused transformer kernels as ``torch.library`` custom ops (``torch.ops.sbp_torch.*``); see docs/kernels.md.

Each op has a pure-PyTorch reference (what runs on CPU, equal to the unfused expression it replaces), a fake
implementation for tracing, an autograd formula, and an SBP rule (``_rules.py``, registered on import).
"""

from . import _rules  # noqa: F401  (registers the ops' signature rules)
from ._bias_dropout_add import bias_dropout_add
from ._bias_gelu import bias_gelu
from ._cross_entropy import cross_entropy
from ._cuda import enable_cuda_kernels
from ._norms import layer_norm, rms_norm
from ._softmax import scale_mask_softmax
