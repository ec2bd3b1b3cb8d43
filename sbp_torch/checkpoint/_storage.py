"""A DCP storage writer and reader for a directory on a shared file system.

What a user may rely on:

- **Published whole or not at all.** Every save writes into a fresh hidden directory beside ``path``; once every
  rank has written and synced its file, the coordinator writes ``.metadata`` there and points the symbolic link
  ``path`` at it with one atomic rename. A save interrupted anywhere leaves ``path`` on the previous checkpoint.
- **Raw bytes, read by range.** A tensor box is stored as its bytes in row-major order, so a rank that needs a
  few rows of a stored box reads those rows' bytes only (plus the checksum blocks around them).
- **Checked.** Every stored item carries a CRC-32 per 1 MiB block; a truncated or altered file is refused,
  naming the entry. ``.metadata`` is unpickled by an unpickler that only builds DCP's metadata classes and
  plain values, and non-tensor entries load with ``torch.load(weights_only=True)``: loading runs no code from
  the checkpoint."""

from __future__ import annotations

import collections
import io
import os
import pickle
import shutil
import uuid
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

BLOCK = 1 << 20  # default bytes per checksum block: what a range read may read beyond its rows, at each end
METADATA = ".metadata"


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read as asked: missing, half written, corrupt, or not matching the
    state it is loaded into. The message names the path or the entry."""


def _as_bytes(data) -> memoryview:
    if isinstance(data, io.BytesIO):
        return data.getbuffer()
    flat = data.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _block_crcs(buf: memoryview, block: int) -> tuple[int, ...]:
    return tuple(zlib.crc32(buf[i : i + block]) for i in range(0, len(buf), block))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Writer(StorageWriter):
    """Writes a checkpoint to ``path`` (a symbolic link that each finished save points at its new directory).
    ``sync_files``: fsync every file and directory before publishing (what makes a published checkpoint survive
    a crash of the machine, not only of the job); ``checksum_block``: bytes per CRC-32."""

    def __init__(self, path: str | os.PathLike, sync_files: bool = True, checksum_block: int = BLOCK):
        super().__init__()
        self.path = Path(path)
        self.sync_files = sync_files
        self.block = checksum_block
        self.staging: Path | None = None

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self.staging = None

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        # Runs on the coordinator; the scattered plans tell every rank where to write and under which name.
        if self.path.exists() and not self.path.is_symlink():
            raise CheckpointError(
                f"{self.path} exists and is not a checkpoint published by sbp_torch.checkpoint (a symbolic link to "
                "its data): choose another path or remove it"
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.staging = self.path.parent / f".{self.path.name}.{uuid.uuid4().hex[:12]}"
        self.staging.mkdir()
        return [replace(plan, storage_data=(str(self.staging), f"rank{i}.data")) for i, plan in enumerate(plans)]

    def write_data(self, plan, planner) -> Future:
        staging, name = plan.storage_data
        results = []
        with open(Path(staging) / name, "wb") as file:
            # bytes entries first, then tensors, in the plan's order: one pass, one part in memory at a time
            for item in sorted(plan.items, key=lambda item: item.type != WriteItemType.BYTE_IO):
                buf = _as_bytes(planner.resolve_data(item))
                offset = file.tell()
                file.write(buf)
                stored = (name, offset, len(buf), self.block, _block_crcs(buf, self.block))
                results.append(WriteResult(index=item.index, size_in_bytes=len(buf), storage_data=stored))
            file.flush()
            if self.sync_files:
                os.fsync(file.fileno())
        done = Future()
        done.set_result(results)
        return done

    def finish(self, metadata, results) -> None:
        metadata.storage_data = {result.index: result.storage_data for rank in results for result in rank}
        with open(self.staging / METADATA, "wb") as file:
            pickle.dump(metadata, file)
            file.flush()
            if self.sync_files:
                os.fsync(file.fileno())
        _publish(self.staging, self.path, self.sync_files)

    def storage_meta(self):
        return dcp_metadata.StorageMeta(checkpoint_id=str(self.path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


def _publish(staging: Path, path: Path, sync: bool) -> None:
    """Point ``path`` at ``staging`` in one atomic step, then remove what ``path`` pointed at before and the
    directories of saves that never finished."""
    link = path.parent / f".{path.name}.link-{uuid.uuid4().hex[:12]}"
    os.symlink(staging.name, link)
    os.replace(link, path)
    if sync:
        _fsync_dir(path.parent)
    for other in path.parent.glob(f".{path.name}.*"):
        if other != staging and other.is_dir() and not other.is_symlink():
            shutil.rmtree(other, ignore_errors=True)


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, torch sizes, dtypes, layouts and memory formats, and builtin values;
    anything else in the file is refused."""

    _DCP = {
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
    }  # fmt: skip
    _PLAIN = {
        ("builtins", t.__name__): t for t in (dict, list, tuple, set, frozenset, int, float, complex, str, bytes, bool)
    } | {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a lookup among torch's layouts
    }

    def find_class(self, module: str, name: str):
        if module == dcp_metadata.__name__ and name in self._DCP:
            return getattr(dcp_metadata, name)
        if (module, name) in self._PLAIN:
            return self._PLAIN[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"the checkpoint's metadata asks for {module}.{name}, which is not metadata")


class Reader(StorageReader):
    """Reads a checkpoint written by ``Writer`` (``path``, the published link, or a checkpoint directory);
    ``bytes_read`` counts what this rank read from the data files."""

    def __init__(self, path: str | os.PathLike, metadata=None):
        super().__init__()
        self.path = Path(path)
        self.metadata = metadata
        self.bytes_read = 0

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
            self.metadata = None

    def read_metadata(self, *args, **kwargs):
        if kwargs.get("rank") is not None:  # DCP's fallback to per-rank metadata: there is none in this format
            raise CheckpointError(f"{self.path}: no per-rank metadata in an sbp_torch checkpoint")
        if self.metadata is None:
            self.metadata = read_metadata(self.path)
        return self.metadata

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.metadata = metadata
        self.directory = self.path.resolve()

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner) -> Future:
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.metadata.storage_data[item.storage_index][0], []).append(item)
        for name, items in by_file.items():
            with open(self.directory / name, "rb") as file:
                for item in sorted(items, key=lambda item: self.metadata.storage_data[item.storage_index][1]):
                    self._read_item(file, item, planner)
        done = Future()
        done.set_result(None)
        return done

    def _read_item(self, file, item, planner) -> None:
        name, offset, length, block, crcs = self.metadata.storage_data[item.storage_index]
        stored_at = _Stored(file, offset, length, block, crcs, f"{item.storage_index.fqn!r} in {self.directory / name}")
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(self._read(stored_at, 0, length)))
            return
        stored = self.metadata.state_dict_metadata[item.storage_index.fqn]
        sizes = _stored_box(stored, item.storage_index).sizes
        dtype = stored.properties.dtype
        if len(sizes) == 0:
            first, rows, row_bytes = 0, 1, dtype.itemsize
        else:  # only the rows of the stored box that this rank needs
            first, rows = item.storage_offsets[0], item.lengths[0]
            row_bytes = dtype.itemsize * torch.Size(sizes[1:]).numel()
        raw = self._read(stored_at, first * row_bytes, (first + rows) * row_bytes)
        values = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        values = values.view(dtype).view(rows, *sizes[1:]) if len(sizes) else values.view(dtype).view(())
        for dim in range(1, len(sizes)):
            values = values.narrow(dim, item.storage_offsets[dim], item.lengths[dim])
        target = planner.resolve_tensor(item).detach()
        target.copy_(values)
        planner.commit_tensor(item, target)

    def _read(self, stored: _Stored, start: int, end: int) -> bytearray:
        """Bytes ``start:end`` of a stored item, reading and checking only the checksum blocks that hold them."""
        block = stored.block
        first, last = start // block, -(-end // block)
        lo, hi = first * block, min(last * block, stored.length)
        buf = bytearray(hi - lo)
        stored.file.seek(stored.offset + lo)
        got = stored.file.readinto(buf)
        self.bytes_read += got
        if got != len(buf):
            raise CheckpointError(
                f"{stored.where}: the file ends early (a save that did not finish, or a truncated copy)"
            )
        view = memoryview(buf)
        for i in range(first, last):
            if zlib.crc32(view[i * block - lo : min((i + 1) * block, stored.length) - lo]) != stored.crcs[i]:
                raise CheckpointError(f"{stored.where}: bytes {i * block} to {(i + 1) * block} fail their checksum")
        return buf[start - lo : end - lo] if (start, end) != (lo, hi) else buf

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


@dataclass(frozen=True)
class _Stored:
    """Where one stored item is: its open file, offset, length, checksum block size and CRCs; ``where`` names it."""

    file: object
    offset: int
    length: int
    block: int
    crcs: tuple
    where: str


def read_metadata(path: Path):
    """The checkpoint's DCP metadata, refusing a directory that holds no finished save and anything but
    metadata in the file."""
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    file = path / METADATA
    if not file.is_file():
        raise CheckpointError(
            f"{path} holds no finished checkpoint: it has no {METADATA} (a save that was interrupted, or not a "
            "checkpoint directory)"
        )
    try:
        with open(file, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{file} is not readable checkpoint metadata: {err}") from err
    if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{file} is not readable checkpoint metadata: it holds a {type(metadata).__name__}")
    return metadata


def _stored_box(stored, index) -> dcp_metadata.ChunkStorageMetadata:
    for box in stored.chunks:
        if tuple(box.offsets) == tuple(index.offset):
            return box
    raise CheckpointError(f"{index.fqn!r}: the metadata lists no stored box at offsets {tuple(index.offset)}")
