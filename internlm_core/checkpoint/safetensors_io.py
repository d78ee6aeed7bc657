"""Safetensors folders as Hugging Face writes them: shard planning, writing one shard at a time (with the index
`model.safetensors.index.json`), finding and reading tensors by name. PyTorch's pytorch_model*.bin files are read
only through torch.load(weights_only=True) (no pickled code runs)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

import torch

from ..errors import CheckpointError


def read_json(path: Path) -> dict:
    """A JSON file's content; CheckpointError naming the file when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from None


def parse_size(text: str | int) -> int:
    """"5GB" / "500MB" / "2GiB" / 1000 → bytes (decimal units as transformers' max_shard_size, binary for *iB)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise CheckpointError(f"max shard size {text!r}: expected a number with an optional unit, e.g. 5GB or 500MB")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(m.group(1)) * scale)


def plan_shards(sizes: Iterable[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Group names (in order) into shards of at most `max_shard_bytes` (a larger tensor gets a shard alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return [s for s in shards if s]


def write_safetensors_shards(names_in_order: list[str], nbytes: Mapping[str, int],
                             load: Callable[[list[str]], Mapping[str, torch.Tensor]], out_dir: Path,
                             max_shard_bytes: int, progress: Optional[Callable[[str], None]] = None) -> list[Path]:
    """Write HF-named tensors as `model.safetensors` or `model-0000i-of-0000n.safetensors` + index.

    `load(names)` returns the HF-named tensors of one shard (already in the output dtype), so that only one
    shard is in memory at a time.
    """
    from safetensors.torch import save_file

    shards = plan_shards(((n, nbytes[n]) for n in names_in_order), max_shard_bytes)
    paths, weight_map, total = [], {}, 0
    for i, names in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = load(names)
        missing = [n for n in names if n not in tensors]
        if missing:
            raise CheckpointError(f"tensors {missing[:3]} were not produced for shard {fname}")
        tensors = {n: tensors[n].contiguous() for n in names}
        save_file(tensors, str(out_dir / fname), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({n: fname for n in names})
        paths.append(out_dir / fname)
        if progress is not None:
            progress(f"wrote {fname} ({len(names)} tensors)")
        del tensors
    if len(shards) > 1:
        index = out_dir / "model.safetensors.index.json"
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        paths.append(index)
    return paths


def hf_safetensors_files(hf_dir: str | os.PathLike) -> dict[str, Path]:
    """HF tensor name → the file holding it: safetensors (from model.safetensors.index.json or the single
    model.safetensors), else PyTorch's pytorch_model*.bin (its index, or the single file), which InternEvo's
    "hf_llama" loads; those are read with torch.load(weights_only=True) only."""
    d = Path(hf_dir)
    for index in (d / "model.safetensors.index.json", d / "pytorch_model.bin.index.json"):
        if index.is_file():
            wm = read_json(index).get("weight_map")
            if not isinstance(wm, dict):
                raise CheckpointError(f"{index}: no weight_map")
            return {k: d / v for k, v in wm.items()}
    single = d / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {k: single for k in f.keys()}
    bins = sorted(d.glob("pytorch_model*.bin"))
    if bins:
        return {k: path for path in bins for k in _bin_tensors(path)}
    raise CheckpointError(f"{d}: no model.safetensors, model.safetensors.index.json or pytorch_model*.bin")


def safe_load(path: Path) -> Any:
    """torch.load(weights_only=True) on the CPU, memory-mapped where the file allows it (torch.save's zip format:
    a tensor is read from disk when it is used, so a load holds one layer, not the file); CheckpointError naming
    the file when it is not plain data."""
    if not Path(path).is_file():
        raise CheckpointError(f"{path}: not found")
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            return torch.load(path, map_location="cpu", weights_only=True)  # the legacy format cannot be mapped
    except Exception as e:  # the unpickler refuses code, unknown globals, truncated files
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: not a plain tensor file, refused by torch.load(weights_only=True) "
                              f"({first[:200]})") from None


def _bin_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a pytorch_model*.bin, memory-mapped, through torch.load(weights_only=True): plain tensors
    and containers only, a file that would run code is refused (CheckpointError naming it)."""
    sd = safe_load(path)
    if not isinstance(sd, Mapping):
        raise CheckpointError(f"{path}: expected a state dict, found {type(sd).__name__}")
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def read_hf_tensors(hf_dir: str | os.PathLike, names: Optional[Iterable[str]] = None) -> dict[str, torch.Tensor]:
    """The HF-named tensors of a folder (all, or only `names`), read from its safetensors (or .bin) files."""
    from safetensors import safe_open

    where = hf_safetensors_files(hf_dir)
    wanted = list(where) if names is None else list(names)
    missing = [n for n in wanted if n not in where]
    if missing:
        raise CheckpointError(f"{hf_dir}: tensor(s) {missing[:3]} not found in its weight files")
    by_file: dict[Path, list[str]] = {}
    for n in wanted:
        by_file.setdefault(where[n], []).append(n)
    out = {}
    for path, keys in by_file.items():
        if path.suffix == ".bin":
            tensors = _bin_tensors(path)
            out.update({k: tensors[k] for k in keys})
            continue
        with safe_open(str(path), framework="pt") as f:
            for k in keys:
                out[k] = f.get_tensor(k)
    return out
