"""DCP's default load planner with the checks a resume needs: the checkpoint and the state must hold the same
keys, shapes and dtypes (checked on every rank before anything is read), and non-tensor entries load with
``torch.load(weights_only=True)``."""

import torch
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ._storage import CheckpointError


def _describe(entry) -> str:
    if isinstance(entry, TensorStorageMetadata):
        return f"a {tuple(entry.size)} {entry.properties.dtype} tensor"
    if isinstance(entry, torch.Tensor):
        return f"a {tuple(entry.shape)} {entry.dtype} tensor"
    return "a non-tensor value" if isinstance(entry, BytesStorageMetadata) else f"a {type(entry).__name__}"


def mismatches(state: dict, stored: dict) -> list[str]:
    """One line per difference between the flattened ``state`` and the checkpoint's entries ``stored``."""
    lines = [f"{key!r} is missing from the checkpoint" for key in state if key not in stored]
    lines += [f"{key!r} is in the checkpoint but not in the state loaded into" for key in stored if key not in state]
    for key in state.keys() & stored.keys():
        want, have = state[key], stored[key]
        same = (
            isinstance(want, torch.Tensor)
            and isinstance(have, TensorStorageMetadata)
            and tuple(want.shape) == tuple(have.size)
            and want.dtype == have.properties.dtype
        ) or (not isinstance(want, torch.Tensor) and isinstance(have, BytesStorageMetadata))
        if not same:
            lines.append(f"{key!r}: the checkpoint holds {_describe(have)}, the state holds {_describe(want)}")
    return sorted(lines)


class CheckedLoadPlanner(DefaultLoadPlanner):
    """Loads only into a state that matches the checkpoint key for key (``CheckpointError`` otherwise, before
    any value changes); never unpickles more than plain data."""

    def create_local_plan(self):
        lines = mismatches(self.state_dict, self.metadata.state_dict_metadata)
        if lines:
            raise CheckpointError("the checkpoint does not match the state to load into:\n  " + "\n  ".join(lines))
        return super().create_local_plan()

    def load_bytes(self, read_item, value) -> None:
        key = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as err:  # torch.load's refusals vary by what it met: name the entry whatever they are
            raise CheckpointError(f"{key!r}: the stored value is not plain data ({err})") from err
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[key], loaded)
        else:
            self.state_dict[key] = loaded
