"""Forwards recomputed in backward (activation checkpointing) see torch functions, as the forwards they repeat did.

Backward entered through a global tensor's ``__torch_function__`` (``loss.backward()``) runs with torch functions
off, so a forward that ``torch.utils.checkpoint`` recomputes there would take torch's own paths where the first
forward took sbp_torch's (``torch.matmul`` of split heads flattened), save other tensors and fail checkpoint's
check. The modules that are usually checkpointed, a model's blocks, turn torch functions back on while they run
inside backward."""

import torch
from torch import nn


class TorchFunctionsInRecompute:
    """The hooks of one module: on while its forward runs inside backward, as before outside it."""

    _ATTRIBUTE = "_sbp_torch_torch_functions_in_recompute"

    @classmethod
    def install(cls, modules) -> None:
        for module in modules:
            if getattr(module, cls._ATTRIBUTE, None) is None:
                hooks = cls()
                setattr(module, cls._ATTRIBUTE, hooks)
                module.register_forward_pre_hook(hooks.enter)
                module.register_forward_hook(hooks.leave, always_call=True)

    def __init__(self):
        self.active: list = []  # per call under way: the context that turned torch functions on, or None

    def enter(self, module: nn.Module, args) -> None:
        if torch.compiler.is_compiling():  # (a traced program has no backward under way)
            return
        on = torch._C._EnableTorchFunction() if torch._C._current_graph_task_id() != -1 else None
        if on is not None:
            on.__enter__()
        self.active.append(on)

    def leave(self, module: nn.Module, args, output) -> None:
        if torch.compiler.is_compiling() or not self.active:
            return
        on = self.active.pop()
        if on is not None:
            on.__exit__(None, None, None)
