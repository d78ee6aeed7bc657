"""What every foreign format (Hugging Face folders, InternLM folders) needs from the generic side: the model
family's adapter, the groups in which an adapter converts (one layer at a time), the global shapes of a model,
and filling a built model of any layout (plain, FSDP2 / tensor parallel, one pipeline stage) from full tensors.

Nothing here names a parameter path: names are grouped by their first numeric component ("layers.3.").
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Mapping, Optional

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from ..utils import collectives
from ..model.spec import AdapterContext, StateDictAdapter, get_model_spec, model_types

_GROUP = re.compile(r"^(.*?\.\d+)\.")


def group_key(name: str) -> str:
    """The unit an adapter converts at once: the prefix up to the first numeric component, else the name."""
    m = _GROUP.match(name)
    return m.group(1) if m else name


def groups(names: Iterable[str]) -> dict[str, list[str]]:
    """Names by group, in first-seen order."""
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(group_key(n), []).append(n)
    return out


def meta_shapes(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Meta tensors of the global shapes (DTensor shapes are global) and dtypes of a state dict."""
    return {k: torch.empty(tuple(v.shape), dtype=v.dtype, device="meta") for k, v in sd.items()}


def find_adapter(model_type: Optional[str], fmt: str, architecture: Optional[str] = None,
                 where: str = "") -> StateDictAdapter:
    """The adapter of family `model_type` (any registered family when None) for format `fmt` ("hf", "internlm")
    that reads `architecture` (HF folders)."""
    families = [get_model_spec(model_type)] if model_type else [get_model_spec(t) for t in model_types()]
    seen = []
    for spec in families:
        for key, ad in spec.adapters.items():
            if ad.format != fmt:
                continue
            if architecture is None and key == fmt:
                return ad
            if architecture is not None and architecture in ad.architectures:
                return ad
            seen.extend(ad.architectures or [ad.description])
    who = f"model_type {families[0].name}" if model_type else "internlm-core"
    if architecture is None:
        raise CheckpointError(f"{where}{who} has no {fmt} checkpoint adapter")
    known = ", ".join(dict.fromkeys(seen)) or "none"
    raise CheckpointError(f"{where}{architecture}: {who} reads {known}")


def distributed_model(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def load_full_state(model: torch.nn.Module, read: Callable[[list[str]], dict[str, torch.Tensor]], where: str,
                    strict: bool = True) -> list[str]:
    """Fill `model` from full (unsharded) tensors; `read(our names)` returns them (a subset when the source lacks
    some: with `strict` that is an error). Returns the names loaded.

    DTensor models (FSDP2, tensor parallel) are filled by `set_model_state_dict(full_state_dict=True,
    broadcast_from_rank0=True)`: rank 0 reads what every rank needs, every rank receives its shards. Plain modules
    (one process, or one pipeline stage without sharding) read their own tensors.
    """
    target = model.state_dict()
    names = list(target)
    shared = distributed_model(model) and dist.is_initialized()
    if shared:
        everyone: list[Any] = [None] * dist.get_world_size()
        collectives.all_gather_object(everyone, names)
        wanted = list(dict.fromkeys(n for ns in everyone for n in ns))
        shapes: dict[str, tuple] = {}
        for sh in _gather_shapes(target):
            shapes.update(sh)
    else:
        wanted = names
        shapes = {k: tuple(v.shape) for k, v in target.items()}
    problem, sd = "", {}
    if not shared or dist.get_rank() == 0:
        try:
            sd = read(wanted)
            missing = [n for n in wanted if n not in sd]
            if missing and strict:
                problem = f"{where}: missing {len(missing)} tensor(s) the model needs, e.g. {', '.join(missing[:3])}"
            for n, t in sd.items():
                if n in shapes and tuple(t.shape) != shapes[n]:
                    problem = problem or (f"{where}: {n} has shape {tuple(t.shape)} there, the model's has "
                                          f"{shapes[n]}")
        except CheckpointError as e:
            problem = str(e)
    if shared:
        box = [problem]
        collectives.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        raise CheckpointError(problem)
    if shared:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        sd = {k: v.to(target[k].dtype) for k, v in sd.items() if k in target} if dist.get_rank() == 0 else {}
        set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                 strict=strict))
        return sorted(names)
    sd = {k: v.to(target[k].dtype) for k, v in sd.items() if k in target}
    result = model.load_state_dict(sd, strict=False)
    if strict and result.missing_keys:
        raise CheckpointError(f"{where}: not loaded into the model: {result.missing_keys[:3]}")
    return sorted(sd)


def _gather_shapes(target: Mapping[str, torch.Tensor]) -> list[dict[str, tuple]]:
    mine = {k: tuple(v.shape) for k, v in target.items()}
    everyone: list[Any] = [None] * dist.get_world_size()
    collectives.all_gather_object(everyone, mine)
    return everyone


def context(args: Any, tp: int = 1, options: Optional[Mapping[str, Any]] = None) -> AdapterContext:
    return AdapterContext(args=args, tp=tp, options=dict(options or {}))
