"""Checkpoints of global training state through ``torch.distributed.checkpoint`` (docs/checkpoint.md).

``dcp.save`` and ``dcp.load`` take global tensors as they take DTensors: importing ``sbp_torch`` gives the type
the methods DCP looks for (``_hooks``), so each rank writes and reads its own boxes and loading reshards.
``save`` and ``load`` here add what a training job needs around DCP: partial tensors, optimizers that have not
stepped, key/shape/dtype checks before anything changes, atomic publication, checksums and loading that runs
no code from the file (``Writer``, ``Reader``). ``full_state_dict`` gives plain tensors on one rank."""

from ._planners import CheckedLoadPlanner
from ._state import full_state_dict, load, save
from ._storage import CheckpointError, Reader, Writer
