"""The parameter and buffer slots of a module tree, for code that lays them out or swaps them."""

from torch import nn


def module_tensors(module: nn.Module, prefix: str = ""):
    """Every parameter and buffer slot of ``module`` and its submodules, a shared tensor once per module holding
    it: (full dotted name under ``prefix``, whether it is a parameter, the holder's table, the name in it, the
    tensor). Empty slots are skipped; the caller may replace ``table[name]`` as it goes."""
    for sub_name, sub in module.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            table = getattr(sub, kind)
            for name, tensor in list(table.items()):
                if tensor is not None:
                    yield ".".join(filter(None, (prefix, sub_name, name))), kind == "_parameters", table, name, tensor
