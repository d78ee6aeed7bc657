"""Loading a checkpoint into the registered state: a local copy of it (downloaded once per node from object storage),
the DCP request (templates of the right shapes for the parts asked for, each per-rank entry taken from the right
saved rank), checks against the checkpoint's index that name every mismatch, the load itself, and handing the
values to their owners. Checkpoints of other formats (`FOREIGN_LOADERS`) load the model only."""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp

from ..config.ckpt_names import FOREIGN_CKPT_TYPES
from ..errors import CheckpointError
from ..utils.logging import get_logger
from .catalog import CheckpointRef
from .collectives import Collectives
from .hf import load_hf
from .internlm_format import load_internlm
from .pth_shards import load_pth_folder
from .registry import StateRegistry
from .safe_dcp import (DCP_ERRORS, SafeFileSystemReader, SafeLoadPlanner, describe, flat_keys, read_dcp_metadata,
                       unwrap)

logger = get_logger(__name__)

# load_ckpt_info.ckpt_type → fn(model, local folder, model_type) -> names loaded: loads the weights of that format
# into the built, parallelized model through the family's adapter (model only: the optimizer and schedules start
# fresh). "internlm_core" is ours, loaded by the manager. The types are the config's (config/ckpt_names.py), which
# validates ckpt_type when the config is loaded: one loader for each of them, checked at import.
FOREIGN_LOADERS: dict[str, Callable[[torch.nn.Module, Path, Optional[str]], list]] = {
    "hf": load_hf,
    "hf_llama": load_hf,
    "internlm": load_internlm,
    "llama": load_pth_folder,
}
if set(FOREIGN_LOADERS) != set(FOREIGN_CKPT_TYPES):
    raise ImportError(f"checkpoint/restore.py FOREIGN_LOADERS {sorted(FOREIGN_LOADERS)} must have one loader for each "
                      f"foreign ckpt_type of config/ckpt_names.py {sorted(FOREIGN_CKPT_TYPES)}")


@dataclass
class LoadResult:
    """What a load restored: from where, at which step, which content, and whether the layout matched."""

    url: str
    step: int
    content: tuple[str, ...]
    same_layout: bool
    saved_layout: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def local_copy(ref: CheckpointRef, coll: Collectives, download_root: Path) -> tuple[Path, Callable[[], None]]:
    """A local folder holding the checkpoint (downloaded from object storage by each node's local rank 0 into
    `download_root`) and the function that removes the download afterwards (a collective)."""
    folder = ref.storage.local_path(ref.name)
    if folder is not None:
        return folder, lambda: None
    folder = download_root / f"{(ref.name or 'root').replace('/', '_')}-step{ref.step}"
    ok, error = True, ""
    if coll.local_rank == 0:
        try:
            t0 = time.perf_counter()
            ref.storage.download(ref.name, ref.files(), folder)
            logger.info("downloaded %s to %s in %.1f s", ref.url, folder, time.perf_counter() - t0)
        except Exception as e:
            ok, error = False, str(e)
    ok, error = coll.agree(ok, error)
    if not ok:
        raise CheckpointError(f"checkpoint {ref.url}: download failed: {error}")

    def cleanup() -> None:
        coll.barrier()
        if coll.local_rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    return folder, cleanup


def read_into(registry: StateRegistry, folder: Path, url: str, parts: tuple[str, ...], coll: Collectives,
              dp_rank: int) -> list[str]:
    """Load `parts` of the DCP checkpoint in `folder` into the registered state; notes on per-rank sources."""
    index = read_dcp_metadata(folder).state_dict_metadata
    request, apply, notes = build_request(registry, parts, index, url, coll, dp_rank)
    try:
        dcp.load(request, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner(),
                 **coll.dcp_kwargs())
    except CheckpointError:
        raise
    except DCP_ERRORS as e:
        inner = unwrap(e)
        if isinstance(inner, CheckpointError):
            raise inner from None
        raise CheckpointError(f"checkpoint {url}: loading failed on rank {coll.rank}: {describe(inner)}") from e
    apply(request)
    return notes


def build_request(registry: StateRegistry, parts: tuple[str, ...], index: dict, url: str, coll: Collectives,
                  dp_rank: int) -> tuple[dict, Callable[[dict], None], list[str]]:
    """The state dict DCP fills (templates of the right shapes), checked against the checkpoint's index,
    the function that hands the loaded values to their owners, and notes on per-rank sources."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)
    request: dict[str, Any] = {}
    notes: list[str] = []
    want_model, want_optim = "model" in parts, "optimizer" in parts and registry.optimizer is not None
    if want_model or want_optim:
        msd, osd = registry.model_state(with_optimizer=want_optim)
        if want_model:
            check_model(msd, index, url, coll)
            request["model"] = msd
        if want_optim:
            request["optimizer"] = osd
    sources: dict[str, str] = {}
    for e in registry.entries.values():
        if e.content not in parts:
            continue
        template = e.obj.state_dict()
        if e.scope == "global":
            key = e.name
        else:
            unit, mine = ("dp", dp_rank) if e.scope == "dp_rank" else ("rank", coll.rank)
            saved_ids = sorted({int(m.group(1)) for k in index
                                if (m := re.match(rf"^{re.escape(e.name)}\.{unit}(\d+)\.", k))})
            if not saved_ids:
                if e.strict:
                    raise CheckpointError(f"checkpoint {url} has no '{e.name}' state (saved by another version?)")
                continue
            src = mine if mine in saved_ids else saved_ids[mine % len(saved_ids)]
            if src != mine:
                notes.append(f"{e.name}: {unit} rank {mine} takes the state saved by {unit} rank {src}")
            key = f"{e.name}.{unit}{src}"
            template = {f"{unit}{src}": template}
        if not e.strict:
            template = _only_present(template, key if e.scope == "global" else e.name, index)
            if template is _MISSING:
                continue
        request[e.name] = template
        sources[e.name] = key
    check_entries(request, index, url)
    opts = StateDictOptions(flatten_optimizer_state_dict=True)

    def apply(loaded: dict) -> None:
        if want_model:
            set_model_state_dict(registry.model, loaded["model"], options=opts)
        if want_optim:
            set_optimizer_state_dict(registry.model, registry.optimizer, loaded["optimizer"], options=opts)
        for name, key in sources.items():
            e = registry.entries[name]
            value = loaded[name]
            if e.scope != "global":
                value = value[key.split(".", 1)[1]]
            e.obj.load_state_dict(value)
        if want_optim and "scheduler" not in parts:
            for e in registry.entries.values():  # the loaded param_groups carry the old lr/betas: fresh schedule
                if e.content == "scheduler":
                    e.obj.load_state_dict(e.obj.state_dict())
    return request, apply, notes


def check_model(msd: dict, index: dict, url: str, coll: Collectives) -> None:
    """Every parameter of the model (all ranks together) is in the checkpoint with its shape, and nothing else."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    mine = {k: tuple(v.shape) for k, v in msd.items() if isinstance(v, torch.Tensor)}
    model: dict[str, tuple] = {}
    for d in coll.all_gather(mine):
        model.update(d)
    saved = {k[len("model."):]: m for k, m in index.items() if k.startswith("model.")}
    problems = []
    for k in sorted(model):
        m = saved.get(k)
        if m is None:
            problems.append(f"parameter '{k}' (shape {_shape(model[k])}) is missing from the checkpoint")
        elif isinstance(m, TensorStorageMetadata) and tuple(m.size) != model[k]:
            problems.append(f"parameter '{k}' has shape {_shape(tuple(m.size))} in the checkpoint but "
                            f"{_shape(model[k])} in the model")
    for k in sorted(set(saved) - set(model)):
        problems.append(f"parameter '{k}' is in the checkpoint but not in the model")
    if problems:
        raise CheckpointError(f"checkpoint {url} does not match the model: {_first(problems)}")


def check_entries(request: dict, index: dict, url: str) -> None:
    """Every leaf asked for (besides the model) is in the checkpoint, as a tensor of its shape or as an object."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    problems = []
    for k, v in flat_keys({n: s for n, s in request.items() if n != "model"}).items():
        m = index.get(k)
        if m is None:
            problems.append(f"'{k}' is missing from the checkpoint")
        elif isinstance(v, torch.Tensor) and isinstance(m, TensorStorageMetadata) and tuple(m.size) != tuple(v.shape):
            problems.append(f"'{k}' has shape {_shape(tuple(m.size))} in the checkpoint but {_shape(tuple(v.shape))} here")
        elif isinstance(v, torch.Tensor) != isinstance(m, TensorStorageMetadata):
            problems.append(f"'{k}' is {'a tensor' if isinstance(m, TensorStorageMetadata) else 'not a tensor'} "
                            "in the checkpoint")
    if problems:
        raise CheckpointError(f"checkpoint {url} does not match this run's state: {_first(problems)}")


def _first(problems: list[str], n: int = 6) -> str:
    more = f"; and {len(problems) - n} more" if len(problems) > n else ""
    return f"{'; '.join(problems[:n])}{more}"


def _shape(shape: tuple) -> str:
    return str(tuple(int(s) for s in shape))


def _only_present(template: Any, prefix: str, index: dict) -> Any:
    """`template` without the leaves the checkpoint does not hold (DCP's flattened names)."""
    if isinstance(template, dict):
        out = {}
        for k, v in template.items():
            sub = _only_present(v, f"{prefix}.{k}", index)
            if sub is not _MISSING:
                out[k] = sub
        return out if out else _MISSING
    return template if prefix in index else _MISSING


_MISSING: Any = object()
