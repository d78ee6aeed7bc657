"""Folders of one `.pth` state dict per model-parallel rank plus a config file (ckpt_type "llama": Meta's original
Llama folders; InternEvo's configs write "LLAMA"), read into any layout of internlm-core.

What such a folder holds is the family's knowledge, in its adapter of that format (model/llama/meta.py: the
files' names and order, `params.json`, merging the model-parallel shards, the rotary order of q/k rows); this
module is the generic reader: it finds the adapter, checks the model against the folder's config and hands the
adapter each layer's tensors of every shard. Every file is read with `torch.load(weights_only=True)`
(safetensors_io.safe_load): tensors and plain containers only, memory-mapped, so that the reading rank holds one
layer at a time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from ..errors import CheckpointError
from ..model.spec import StateDictAdapter
from .foreign import check_model_keys, context, find_adapter, load_full_state, select_layers
from .safetensors_io import read_json, safe_load

FORMAT = "llama"  # the ckpt_type of these folders (restore.FOREIGN_LOADERS)


def _folder_config(adapter: StateDictAdapter, folder: str | os.PathLike) -> dict:
    """Our `model` keys of the model in `folder`, from its config file as the family's adapter reads it."""
    path = Path(folder) / adapter.config_file
    return adapter.config_from_foreign(read_json(path), str(path))  # type: ignore[misc, call-arg]


def config_from_pth_folder(folder: str | os.PathLike, model_type: Optional[str] = None) -> dict:
    """Our `model` keys of the model in a folder of this format (model_type: the family whose adapter reads it;
    None: the first registered family that has one)."""
    return _folder_config(find_adapter(model_type, FORMAT, where=f"{folder}: ckpt_type {FORMAT}: "), folder)


def _shards(files: list[Path]) -> dict[int, Mapping[str, torch.Tensor]]:
    out: dict[int, Mapping[str, torch.Tensor]] = {}
    for r, f in enumerate(files):
        sd = safe_load(f)
        if not isinstance(sd, Mapping):
            raise CheckpointError(f"{f}: expected a state dict, found {type(sd).__name__}")
        out[r] = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    return out


def load_pth_folder(model: torch.nn.Module, folder: str | os.PathLike, model_type: Optional[str] = None,
                    strict: bool = True) -> list[str]:
    """Load a folder of this format (any number of model-parallel shards) into our built `model` (any layout);
    returns the names this rank loaded. The model's shape, rotary base and norm epsilon must match the folder's
    config."""
    adapter = find_adapter(model_type, FORMAT, where=f"{folder}: ckpt_type {FORMAT}: ")
    args = getattr(model, "args", None)
    if args is None:
        raise CheckpointError(f"a ckpt_type {FORMAT} folder loads into internlm-core's model (it has no .args here)")
    keys = _folder_config(adapter, folder)
    check_model_keys(args, keys, str(Path(folder) / adapter.config_file), f"the folder's {adapter.config_file}",
                     numerics=True)
    files = adapter.shard_files(folder)  # type: ignore[misc]
    state: dict[str, Any] = {}  # the shards, read once (memory-mapped) by the reading rank

    def read(metas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not state:
            state["shards"] = _shards(files)
        part = {r: select_layers(sd, metas) for r, sd in state["shards"].items()}  # this layer's tensors only
        sd = adapter.from_foreign(part, context(args, tp=len(part)))
        return {k: v for k, v in sd.items() if k in metas}

    return load_full_state(model, read, str(folder), strict=strict)
