"""Meta's original Llama folders (ckpt_type "llama"; InternEvo's configs write "LLAMA"): `params.json` and
`consolidated.00.pth` ... `consolidated.NN.pth`, one state dict per model-parallel rank of the run that saved them.

Read into any layout of internlm-core through the model family's "llama" adapter (model/llama/meta.py), which
merges the model-parallel shards and puts q/k rows into our rotary order. As InternEvo's loader, a folder without
`consolidated.*.pth` files may hold other `*.pth` files, taken in name order as model-parallel ranks 0, 1, ...
Every file is read with `torch.load(weights_only=True)` (safetensors_io.safe_load): tensors and plain containers
only, memory-mapped, so that the reading rank holds one layer at a time.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from ..errors import CheckpointError
from .foreign import check_model_keys, context, find_adapter, load_full_state, select_layers
from .safetensors_io import read_json, safe_load

PARAMS = "params.json"
_CONSOLIDATED = re.compile(r"^consolidated\.(\d+)\.pth$")


def meta_llama_files(folder: str | os.PathLike) -> list[Path]:
    """The model-parallel shards of a Meta folder, in rank order (CheckpointError when there are none)."""
    d = Path(folder)
    if not d.is_dir():
        raise CheckpointError(f"{d}: Meta Llama checkpoint folder not found")
    found = sorted(((int(m.group(1)), p) for p in d.iterdir() if (m := _CONSOLIDATED.match(p.name))))
    if found:
        ranks = [r for r, _ in found]
        if ranks != list(range(len(ranks))):
            raise CheckpointError(f"{d}: consolidated.*.pth numbered {ranks}; expected 00 to {len(ranks) - 1:02d}")
        return [p for _, p in found]
    other = sorted(p for p in d.iterdir() if p.suffix in (".pth", ".pt") and p.is_file())
    if not other:
        raise CheckpointError(f"{d}: no consolidated.NN.pth (or other .pth) files of a Meta Llama checkpoint")
    return other


def is_meta_llama_folder(folder: str | os.PathLike) -> bool:
    """True when `folder` holds a params.json and consolidated.NN.pth files."""
    d = Path(folder)
    return (d / PARAMS).is_file() and any(_CONSOLIDATED.match(p.name) for p in d.iterdir())


def config_from_meta_llama(folder: str | os.PathLike, model_type: Optional[str] = "LLAMA") -> dict:
    """Our `model` keys of the model in a Meta folder (from its params.json)."""
    path = Path(folder) / PARAMS
    return find_adapter(model_type, "llama").config_from_foreign(read_json(path), str(path))  # type: ignore[misc, call-arg]


def _shards(files: list[Path]) -> dict[int, Mapping[str, torch.Tensor]]:
    out: dict[int, Mapping[str, torch.Tensor]] = {}
    for r, f in enumerate(files):
        sd = safe_load(f)
        if not isinstance(sd, Mapping):
            raise CheckpointError(f"{f}: expected a state dict, found {type(sd).__name__}")
        out[r] = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    return out


def load_meta_llama(model: torch.nn.Module, folder: str | os.PathLike, model_type: Optional[str] = None,
                    strict: bool = True) -> list[str]:
    """Load a Meta Llama folder (any number of model-parallel shards) into our built `model` (any layout);
    returns the names this rank loaded. The model's shape, rotary base and norm epsilon must match params.json."""
    adapter = find_adapter(model_type, "llama", where=f"{folder}: ckpt_type llama: ")
    args = getattr(model, "args", None)
    if args is None:
        raise CheckpointError("a Meta Llama checkpoint loads into internlm-core's model (it has no .args here)")
    path = Path(folder) / PARAMS
    keys = adapter.config_from_foreign(read_json(path), str(path))  # type: ignore[misc, call-arg]
    check_model_keys(args, keys, str(path), "the Meta Llama params.json", numerics=True)
    files = meta_llama_files(folder)
    state: dict[str, Any] = {}  # the shards, read once (memory-mapped) by the reading rank

    def read(metas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not state:
            state["shards"] = _shards(files)
        part = {r: select_layers(sd, metas) for r, sd in state["shards"].items()}  # this layer's tensors only
        sd = adapter.from_foreign(part, context(args, tp=len(part)))
        return {k: v for k, v in sd.items() if k in metas}

    return load_full_state(model, read, str(folder), strict=strict)
