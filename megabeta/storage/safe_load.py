"""Reading a checkpoint without running code from it.

A pickle can call any importable function while it loads, so a checkpoint directory someone hands
you is code unless every pickle in it is read with an allowlist. What megabeta reads, and how:

- `train_state.json`: JSON.
- `rng/rank_*.pt`: `torch.load(weights_only=True)`: tensors, numbers, strings and containers.
- DCP `model/.metadata`: a pickle of DCP's metadata classes, read by `MetadataUnpickler`, which
  refuses any other global; DCP's non-tensor entries (the optimizer's hyperparameters) with
  `torch.load(weights_only=True)` (`SafeLoadPlanner`); the shards themselves are raw tensor bytes.
- DeepSpeed engine files (`model/engine/*.pt`) are loaded by DeepSpeed with full pickle: trusted
  input. Resume a DeepSpeed run only from checkpoints your own jobs wrote.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}
"""What DCP's metadata pickle may name (besides torch dtypes): its own dataclasses and enums."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any global outside `_METADATA_GLOBALS` is an UnpicklingError."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = name in _METADATA_GLOBALS.get(module, ())
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: a DCP metadata file "
                                         "names only DCP's own classes")
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the metadata read through `MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} holds a {type(metadata).__name__}, not DCP "
                                         "metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor entries with `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        super().load_bytes(read_item, io.BytesIO(_safe_bytes(value, read_item)))


def _safe_bytes(value: io.BytesIO, read_item: ReadItem) -> bytes:
    """The entry's bytes after checking they load under weights_only (what DCP then loads)."""
    raw = value.read()
    try:
        torch.load(io.BytesIO(raw), weights_only=True)
    except pickle.UnpicklingError as err:
        raise pickle.UnpicklingError(f"checkpoint entry {read_item.dest_index.fqn!r} is not plain "
                                     f"data ({str(err).splitlines()[0]})") from None
    return raw


def dcp_reader(model_dir: Path) -> dict[str, Any]:
    """`dcp.load` keyword arguments that read `model_dir` safely."""
    return {"storage_reader": SafeFileSystemReader(str(model_dir)), "planner": SafeLoadPlanner()}
