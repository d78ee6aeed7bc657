"""Context parallel in the config: `parallel.context` (an int or a dict), InternEvo's spellings of it (the isp
tensor mode, `parallel.sequence_2D`) mapped onto it, and the splits it cannot make.

    context_forms(par, isp_size, mapped, compat)   # in compat.normalize, on the raw `parallel` dict
    check_context(cfg, world_size)                 # in the loader's layout checks
"""

from __future__ import annotations

from typing import Any, Optional

from ..errors import ConfigError
from ..model.spec import get_model_spec

MODES = ("ring", "all_to_all", "2d")
_DICT_KEYS = ("size", "mode", "inner", "head_size")
# InternEvo's parallel.sequence_2D (internlm/core/context/parallel_context.py and its config docs)
_SEQUENCE_2D_KEYS = ("enable", "head_size", "context_size", "window_size", "device_placement_strategy")


def _context_dict(value: Any) -> dict:
    """`parallel.context` as dict(size, mode, inner): an int is the size; head_size is InternEvo's name of inner."""
    if isinstance(value, bool) or not isinstance(value, (int, dict)):
        raise ConfigError(f"parallel.context: expected an int (the size) or dict(size, mode, inner), got {value!r}")
    if isinstance(value, int):
        return {"size": value}
    unknown = sorted(set(value) - set(_DICT_KEYS))
    if unknown:
        raise ConfigError(f"parallel.context: unknown key(s) {unknown}; expected size, mode, inner (or head_size)")
    out = dict(value)
    if "head_size" in out:
        if "inner" in out and out["inner"] != out["head_size"]:
            raise ConfigError(f"parallel.context: inner={out['inner']} and head_size={out['head_size']} name the "
                              f"same thing; give one")
        out["inner"] = out.pop("head_size")
    return out


def _sequence_2d(par: dict, isp_size: Optional[int], compat: list[str]) -> Optional[dict]:
    """InternEvo's sequence_2D as a context dict (mode 2d over the isp ranks, inner = head_size); None when it is
    absent or not enabled (then its keys are noted as kept for compatibility only)."""
    s2d = par.pop("sequence_2D", None)
    if s2d is None:
        return None
    if not isinstance(s2d, dict):
        raise ConfigError(f"parallel.sequence_2D: expected dict({', '.join(_SEQUENCE_2D_KEYS)}), got {s2d!r}")
    unknown = sorted(set(s2d) - set(_SEQUENCE_2D_KEYS))
    if unknown:
        raise ConfigError(f"parallel.sequence_2D: unknown key(s) {unknown}; expected {', '.join(_SEQUENCE_2D_KEYS)}")
    if not s2d.get("enable"):
        compat.append("parallel.sequence_2D (enable=False)")
        return None
    head, ctx = int(s2d.get("head_size", 1)), int(s2d.get("context_size", 1))
    if isp_size is None:
        raise ConfigError("parallel.sequence_2D.enable=True: InternEvo's 2D sequence parallel runs over the isp "
                          "tensor group; set parallel.tensor=dict(size=head_size * context_size, mode='isp') (or "
                          "parallel.context=dict(size=N, mode='2d', inner=head_size))")
    if head < 1 or ctx < 1 or head * ctx != isp_size:
        raise ConfigError(f"parallel.sequence_2D: head_size ({head}) * context_size ({ctx}) must equal the isp "
                          f"tensor size ({isp_size}) (InternEvo's rule)")
    for key in ("window_size", "device_placement_strategy"):
        if key in s2d:
            compat.append(f"parallel.sequence_2D.{key} (rank placement is the mesh's: the head ranks are neighbours)")
    return {"size": isp_size, "mode": "2d", "inner": head}


def context_forms(par: dict, isp_size: Optional[int], mapped: list[str], compat: list[str]) -> None:
    """Normalize `par` (the raw parallel section, a copy) in place: `context` becomes a dict; InternEvo's isp tensor
    mode of size N (`isp_size`, its tensor size already set to 1 by the caller) becomes context all_to_all of size N,
    or mode 2d when sequence_2D is enabled."""
    s2d = _sequence_2d(par, isp_size, compat)
    if "context" in par:
        par["context"] = _context_dict(par["context"])
    if isp_size is None or isp_size <= 1:
        return
    if par.get("context", {}).get("size", 1) not in (1, isp_size):
        raise ConfigError(f"parallel.context={par['context']} and parallel.tensor=dict(size={isp_size}, mode='isp') "
                          f"both ask for context parallel; give one")
    ctx = s2d or {"size": isp_size, "mode": "all_to_all"}
    par["context"] = {**ctx, **{k: v for k, v in par.get("context", {}).items() if k != "size"}}
    what = (f"2D sequence parallel: context {isp_size}, mode 2d, inner (head_size) {ctx.get('inner')}" if s2d
            else f"context parallel {isp_size}, mode all_to_all (Ulysses)")
    mapped.append(f"parallel.tensor.mode='isp' size {isp_size} (InternEvo's intern sequence parallel) -> {what}, "
                  f"parallel.tensor=1: the {isp_size} ranks share each sequence, FSDP shards the weights over them")


def check_context(cfg: Any, world_size: Optional[int]) -> None:
    """The context split against the model, the batch, the other dimensions and (when known) the world size."""
    c, p, m, d = cfg.parallel.context, cfg.parallel, cfg.model, cfg.data
    if c.size < 1:
        raise ConfigError(f"parallel.context.size: expected a positive integer, got {c.size}")
    if c.mode not in MODES:
        raise ConfigError(f"parallel.context.mode: expected one of {', '.join(MODES)}, got {c.mode!r}")
    if c.size == 1:
        return
    if d.seq_len % (2 * c.size):
        raise ConfigError(f"data.seq_len ({d.seq_len}) must be divisible by 2 * parallel.context.size "
                          f"(2 * {c.size}): each rank keeps two of the 2 * size zigzag chunks of every sequence")
    heads = m.num_attention_heads // p.tensor
    kv = (m.num_kv_attention_heads or m.num_attention_heads) // p.tensor
    a2a = c.size if c.mode == "all_to_all" else c.inner if c.mode == "2d" else 1
    if c.mode == "2d" and (c.inner < 1 or c.size % c.inner):
        raise ConfigError(f"parallel.context.inner ({c.inner}) must divide parallel.context.size ({c.size}) "
                          f"in mode 2d")
    if heads % a2a:
        raise ConfigError(f"parallel.context: mode {c.mode} exchanges heads over {a2a} ranks, but each tensor-parallel "
                          f"rank has {heads} query heads (model.num_attention_heads {m.num_attention_heads} / "
                          f"parallel.tensor {p.tensor}); use mode 'ring' or a size dividing the heads")
    if kv % a2a and a2a % kv:
        raise ConfigError(f"parallel.context: mode {c.mode} over {a2a} ranks and {kv} key/value heads per "
                          f"tensor-parallel rank: one must divide the other")
    # an MoE family (one with dimensions of its own): its routing statistics, aux losses and expert-bias loads are
    # reduced over the context ranks (model/moe), but a capacity is a count of each forward's own tokens
    moe = bool(get_model_spec(cfg.model_type).plan.mesh_dims)
    if moe and "dropless" not in str(m.moe_type).lower() and cfg.moe.drop_tokens:
        raise ConfigError(f"parallel.context.size > 1 with model.moe_type {m.moe_type} and moe.drop_tokens=True: an "
                          f"expert's capacity would be counted over each rank's chunk of the sequences, not over the "
                          f"sequences as one rank routes them; use model.moe_type Dropless or moe.drop_tokens=False")
    if world_size is not None and world_size % (p.tensor * p.pipeline * c.size):
        raise ConfigError(f"world size {world_size} is not divisible by parallel.tensor * parallel.pipeline * "
                          f"parallel.context.size ({p.tensor} * {p.pipeline} * {c.size})")
