"""DCP without unpickling arbitrary objects, a writer that can be interrupted on purpose in tests, DCP's errors.

Stock DCP reads `.metadata` with `pickle.load` and non-tensor items with `torch.load(weights_only=False)`:
a crafted checkpoint could run code on load. Here `.metadata` goes through an unpickler that only builds
DCP's own metadata classes (and torch.Size / dtypes / layouts), and non-tensor items through
`torch.load(weights_only=True)` (containers, numbers, strings, tensors). Tensors were already read with
`weights_only=True` by DCP itself.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..errors import CheckpointError
from . import events

_DCP_METADATA_CLASSES = ("Metadata", "MetadataIndex", "BytesStorageMetadata", "TensorStorageMetadata",
                         "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    *(("torch.distributed.checkpoint.metadata", n) for n in _DCP_METADATA_CLASSES),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and nothing else: any other global is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")


def load_dcp_metadata(stream: BinaryIO, where: str) -> Metadata:
    """DCP's `.metadata` through the restricted unpickler; a CheckpointError for anything else."""
    try:
        md = _MetadataUnpickler(stream).load()
    except Exception as e:
        raise CheckpointError(f"{where}: not a valid DCP index ({type(e).__name__}: {e}); refusing to load it") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{where}: not a DCP index (holds a {type(md).__name__}); refusing to load it")
    return md


def read_dcp_metadata(folder: str | Path) -> Metadata:
    path = Path(folder) / ".metadata"
    try:
        with open(path, "rb") as f:
            return load_dcp_metadata(f, str(path))
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: no .metadata (not a checkpoint, or an incomplete one)") from None


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is read by the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank) if hasattr(self, "_get_metadata_path") else Path(self.path) / ".metadata"
        with self.fs.create_stream(path, "rb") as f:
            md = load_dcp_metadata(f, str(path))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor items with `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            raise CheckpointError(f"checkpoint item {fqn!r}: refusing to load it ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''})") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class InterruptibleWriter(FileSystemWriter):
    """FileSystemWriter (fsync on, as DCP's default) that announces the phase "shards_written" (events.py):
    every rank's shards are written and durable, DCP's index is not."""

    def __init__(self, path: str | Path, step: int, **kwargs: Any):
        super().__init__(path, sync_files=True, **kwargs)
        self._step = step

    def finish(self, metadata: Metadata, results: Any) -> None:
        events.emit("shards_written", self._step)
        super().finish(metadata, results)


def flat_keys(state: dict) -> dict[str, Any]:
    """DCP's flattened view of a nested state dict: {"model.layers.0.w": tensor, "train_state.step": 3, ...}."""
    flat, _ = flatten_state_dict(state)
    return flat


# DCP raises CheckpointException, a BaseException: catch it with the ordinary ones
DCP_ERRORS = (Exception, CheckpointException)


def unwrap(e: BaseException) -> BaseException:
    """The first rank's underlying error of a DCP CheckpointException (ours if one of ours is there)."""
    if isinstance(e, CheckpointException):
        inner = [v[0] if isinstance(v, tuple) else v for v in e.failures.values()]
        ours = [x for x in inner if isinstance(x, CheckpointError)]
        if ours or inner:
            return (ours or inner)[0]
    return e


def describe(e: BaseException) -> str:
    """An error as one line: ours as its message, others with their type."""
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
