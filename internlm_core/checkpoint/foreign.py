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
_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


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


def check_model_keys(args: Any, keys: Mapping[str, Any], source: str, what: str, hint: str = "",
                     numerics: bool = False) -> None:
    """CheckpointError when the `model` keys a foreign config implies (`keys`) differ from the built model's
    `args` (ModelArgs); `what` names the foreign config ("the Hugging Face config"). `numerics`: the rotary base
    and the norm epsilon too (the shapes would load, the outputs would differ)."""
    ours = {"num_layers": args.num_layers, "hidden_size": args.hidden_size, "num_attention_heads": args.num_heads,
            "num_kv_attention_heads": args.num_kv_heads, "vocab_size": args.vocab_size,
            "intermediate_size": args.ffn_width, "qkv_bias": bool(args.qkv_bias),
            "tie_word_embeddings": bool(args.tie_word_embeddings)}
    # the shared block's options (model/args.py), where the foreign config states them
    ours.update(head_dim=args.head_dim, qk_norm=bool(args.qk_norm), sliding_window=args.sliding_window)
    keys = dict(keys)
    if numerics:
        ours.update(rope_base=float(args.rope_base), layer_norm_epsilon=float(args.norm_eps))
    if "rope_scaling" in keys:  # the same scaling, whichever spelling (type / rope_type) each side uses
        ours["rope_scaling"] = _scaling(args.rope_scaling)
        keys["rope_scaling"] = _scaling(keys["rope_scaling"])
    diff = [f"{k}: model {v} vs {source} {keys[k]}" for k, v in ours.items() if k in keys and keys[k] != v]
    if diff:
        raise CheckpointError(f"the model does not match {what} ({'; '.join(diff)})" + (f"; {hint}" if hint else ""))


def _scaling(scaling: Optional[Mapping[str, Any]]) -> Optional[dict]:
    """A rope_scaling dict in one spelling (None: no scaling)."""
    if not scaling or str(scaling.get("rope_type") or scaling.get("type") or "default") == "default":
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    return {"kind": kind, **{k: v for k, v in scaling.items() if k not in ("type", "rope_type", "rope_theta") and v is not None}}


# ---------------------------------------------------------------------------------------------------------
# filling a model of any layout

Reader = Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]]


def layer_index(name: str) -> Optional[int]:
    """The first numeric component of a name (its layer: `layers.3.x`, `blocks.3.x`, `model.layers.3.x` → 3)."""
    m = _INDEX.search(name)
    return int(m.group(1)) if m else None


def batches(names: Iterable[str]) -> list[list[str]]:
    """The units a load reads, converts and sends at once: each layer group, then every name outside the layers
    together (embedding, final norm, output: a foreign format may pack them jointly, e.g. a tied output)."""
    layers: dict[str, list[str]] = {}
    rest: list[str] = []
    for n in names:
        if layer_index(n) is None:
            rest.append(n)
        else:
            layers.setdefault(group_key(n), []).append(n)
    return [*layers.values(), *([rest] if rest else [])]


def select_layers(state: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """The entries of a foreign state dict that the layers of our `names` come from: the same layer numbers (a
    foreign format numbers its layers as we do), or, for names outside the layers, every entry outside them."""
    wanted = {layer_index(n) for n in names}
    return {k: v for k, v in state.items() if layer_index(k) in wanted}


def _global_metas(target: Mapping[str, torch.Tensor], shared: bool) -> dict[str, torch.Tensor]:
    """Meta tensors (global shape, the model's dtype) of every name any rank holds, in one order on every rank."""
    mine = {k: (tuple(v.shape), v.dtype) for k, v in target.items()}
    if not shared:
        everyone = [mine]
    else:
        everyone = [None] * dist.get_world_size()
        collectives.all_gather_object(everyone, mine)
    out: dict[str, torch.Tensor] = {}
    for d in everyone:
        for k, (shape, dtype) in d.items():
            out.setdefault(k, torch.empty(shape, dtype=dtype, device="meta"))
    return out


def _read_batch(read: Reader, metas: dict[str, torch.Tensor], where: str,
                strict: bool) -> tuple[str, dict[str, torch.Tensor], Optional[BaseException]]:
    """(problem or "", the batch's full tensors in the model's dtypes, an unexpected error to re-raise)."""
    try:
        got = read(metas)
    except CheckpointError as e:
        return str(e), {}, None
    except Exception as e:  # a bug: the reading rank re-raises it with its traceback, the others learn of it
        return f"{where}: reading failed on rank 0: {type(e).__name__}: {e}", {}, e
    missing = [n for n in metas if n not in got]
    if missing and strict:
        return (f"{where}: missing {len(missing)} tensor(s) the model needs, e.g. {', '.join(missing[:3])}", {},
                None)
    for n, t in got.items():
        if n in metas and tuple(t.shape) != tuple(metas[n].shape):
            return f"{where}: {n} has shape {tuple(t.shape)} there, the model's has {tuple(metas[n].shape)}", {}, None
    return "", {n: got[n].to(metas[n].dtype) for n in metas if n in got}, None


def _copy_into(dst: torch.Tensor, full: torch.Tensor, name: str) -> None:
    """Write this rank's part of the full tensor `full` into `dst` (a DTensor's local shard, or all of it)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(dst, DTensor):
        # src_data_rank=None: every rank holds `full` and cuts its own shard, no communication
        part = distribute_tensor(full, dst.device_mesh, dst.placements, src_data_rank=None).to_local()
        local = dst.to_local()
    else:
        part, local = full, dst
    if tuple(part.shape) != tuple(local.shape):
        raise CheckpointError(f"{name}: this rank's part has shape {tuple(part.shape)}, its parameter "
                              f"{tuple(local.shape)}")
    local.copy_(part)


def load_full_state(model: torch.nn.Module, read: Reader, where: str, strict: bool = True,
                    check: Optional[Callable[[dict[str, torch.Tensor]], str]] = None) -> list[str]:
    """Fill `model` (plain, FSDP2 / tensor / expert parallel, one pipeline stage, or any mix) from full
    (unsharded) tensors; returns the names this rank loaded.

    `read({our name: meta tensor of its global shape and the model's dtype})` returns full tensors of those
    names (fewer when the source lacks some: with `strict` that is an error); it is called one layer at a time
    (`batches`). In a job, rank 0 alone reads, for the names of every rank (each pipeline stage its own layers),
    and broadcasts each tensor in turn over the default group; every rank keeps its own shard of the tensors its
    model holds. Memory: rank 0 holds one layer of the source, every rank one full tensor at a time.
    `check(every name's meta)`, on the reading rank before anything is read: a problem ("" for none) that every
    rank raises (e.g. tensors of the source that no name reads).
    """
    target = model.state_dict()
    shared = collectives.dist_ready() and dist.get_world_size() > 1
    metas = _global_metas(target, shared)
    reader = not shared or dist.get_rank() == 0
    device = collectives.group_device() if shared else None
    if check is not None:
        verdict: list[Any] = [""]
        if reader:
            try:
                verdict[0] = check(metas)
            except CheckpointError as e:  # every rank raises it
                verdict[0] = str(e)
        if shared:
            collectives.broadcast_object_list(verdict, src=0)
        if verdict[0]:
            raise CheckpointError(verdict[0])
    loaded: list[str] = []
    with torch.no_grad():
        for names in batches(metas):
            problem, tensors, error = "", {}, None
            if reader:
                problem, tensors, error = _read_batch(read, {n: metas[n] for n in names}, where, strict)
            present = list(tensors)
            if shared:
                box: list[Any] = [(problem, present)]
                collectives.broadcast_object_list(box, src=0)
                problem, present = box[0]
            if error is not None:
                raise error
            if problem:
                raise CheckpointError(problem)
            for n in present:
                full = tensors.pop(n, None)
                if shared:
                    full = (full.to(device).contiguous() if reader else
                            torch.empty(metas[n].shape, dtype=metas[n].dtype, device=device))
                    collectives.broadcast(full, src=0)
                if n in target:
                    _copy_into(target[n], full, n)
                    loaded.append(n)
                del full
    if strict and len(set(loaded)) != len(target):
        raise CheckpointError(f"{where}: not loaded into the model: {[n for n in target if n not in loaded][:3]}")
    return sorted(loaded)


def context(args: Any, tp: int = 1, options: Optional[Mapping[str, Any]] = None) -> AdapterContext:
    return AdapterContext(args=args, tp=tp, options=dict(options or {}))
