"""InternEvo's and InternLM-develop's mixture-of-experts keys, mapped onto the schema (compat.py calls `moe_forms`).

A config is an MoE config when its model_type is an MoE family: a family whose parallel plan has the expert
dimension (`parallel.expert`). Such a config keeps its MoE keys (model.num_experts, model.moe_type,
model.moe_use_residual, the `moe` section, loss.moe_loss_coeff, parallel.expert) and has InternEvo's other
spellings translated: model.top_k and moe_gate_k -> moe.top_k, parallel.expert=dict(size=..., no_tp=...) ->
parallel.expert=size; parallel.expert_zero1 / expert_weight and the kernel switches of the `moe` section are noted
as compatibility-only. A dense family with experts asked for (model.num_experts > 1) is one error naming the MoE
families; its other MoE keys (InternEvo's dense configs carry parallel.expert=dict(size=-1)) are noted and dropped.
"""

from __future__ import annotations

from typing import Any, Optional

from ..errors import ConfigError
from ..model import get_model_spec, model_types

EXPERT_KEY = "expert"  # parallel.expert: the mesh dimension an MoE family declares
MOE_TYPES = {"gshard": "GShard", "megablock": "MegaBlock", "megablock-d": "MegaBlock-Dropless",
             "megablock-dropless": "MegaBlock-Dropless", "dropless": "Dropless"}
# the moe section's switches of InternEvo's own kernels: no effect here
_MOE_KERNEL_KEYS = ("use_fused_gating", "enable_fused_permute", "token_dispatcher", "parallel_mode",
                    "use_grouped_mlp", "moe_grouped_mlp")
# InternEvo / InternLM-develop MoE keys a dense family drops: (section, key)
_DENSE_DROPS = (("model", "moe_type"), ("model", "top_k"), ("model", "moe_use_residual"), ("model", "moe_gate_k"),
                ("model", "moe_intermediate_size"), ("loss", "moe_loss_coeff"), ("parallel", "expert"),
                ("parallel", "expert_weight"), ("parallel", "expert_zero1"), ("", "moe"))
# model/moe/mix.py's keys and their all-MoE defaults: set otherwise on a dense family, refused
_MIX_DEFAULTS = {"first_k_dense_replace": 0, "decoder_sparse_step": 1, "mlp_only_layers": []}


def is_moe_family(model_type: Any) -> bool:
    """Whether `model_type` names a registered family with the expert-parallel dimension."""
    try:
        spec = get_model_spec(str(model_type))
    except ConfigError:
        return False
    return any(d.key == EXPERT_KEY for d in spec.plan.mesh_dims)


def moe_families() -> list[str]:
    return [t for t in model_types() if is_moe_family(t)]


def moe_forms(raw: dict, compat: list[str], mapped: list[str]) -> dict:
    """`raw` with InternEvo's MoE forms mapped (a new dict where changed); notes appended to compat / mapped."""
    from .schema import Config
    if is_moe_family(raw.get("model_type", Config.model_type)):
        return _moe(raw, compat, mapped)
    return _dense(raw, compat)


def _section(raw: dict, name: str) -> dict:
    value = raw.get(name)
    return dict(value) if isinstance(value, dict) else {}


def _dense(raw: dict, compat: list[str]) -> dict:
    model = _section(raw, "model")
    n = model.get("num_experts")
    if isinstance(n, (int, float)) and not isinstance(n, bool) and n > 1:
        raise ConfigError(f"model.num_experts={n}: model_type {raw.get('model_type', 'INTERNLM')!r} is dense; "
                          f"mixture-of-experts needs an MoE model_type ({', '.join(moe_families())})")
    mixed = {k: model[k] for k, default in _MIX_DEFAULTS.items() if model.get(k) not in (None, default)}
    if mixed:
        raise ConfigError(f"model.{', model.'.join(f'{k}={v!r}' for k, v in mixed.items())}: dense blocks among "
                          f"MoE blocks; model_type {raw.get('model_type', 'INTERNLM')!r} is dense throughout "
                          f"(an MoE model_type takes them: {', '.join(moe_families())})")
    raw = dict(raw)
    for section, key in (("model", "num_experts"), *_DENSE_DROPS):
        holder = raw if not section else _section(raw, section)
        if key in holder:
            del holder[key]
            compat.append(f"{section}.{key}" if section else key)
            if section:
                raw[section] = holder
    return raw


def _moe(raw: dict, compat: list[str], mapped: list[str]) -> dict:
    raw = dict(raw)
    model, moe, par = _section(raw, "model"), _section(raw, "moe"), _section(raw, "parallel")
    for holder, key in ((model, "top_k"), (model, "moe_gate_k"), (moe, "moe_gate_k")):
        if key in holder:
            value = holder.pop(key)
            where = "model" if holder is model else "moe"
            if "top_k" in moe and holder is not moe and moe["top_k"] != value:
                raise ConfigError(f"{where}.{key}={value} and moe.top_k={moe['top_k']} disagree")
            moe["top_k"] = value
            mapped.append(f"{where}.{key}={value} -> moe.top_k")
    if "moe_type" in model:
        spelled = MOE_TYPES.get(str(model["moe_type"]).lower())
        if spelled is None:
            raise ConfigError(f"model.moe_type={model['moe_type']!r}: expected one of {sorted(set(MOE_TYPES.values()))}")
        model["moe_type"] = spelled
    for key in _MOE_KERNEL_KEYS:
        if key in moe:
            del moe[key]
            compat.append(f"moe.{key}")
    _expert_parallel(par, compat)
    for name, value in (("model", model), ("moe", moe), ("parallel", par)):
        if value or name in raw:
            raw[name] = value
    return raw


def _expert_parallel(par: dict, compat: list[str]) -> None:
    """parallel.expert=dict(size=..., no_tp=...) -> parallel.expert=size; expert_zero1 / expert_weight noted."""
    exp = par.get(EXPERT_KEY)
    if isinstance(exp, dict):
        unknown = sorted(set(exp) - {"size", "no_tp"})
        if unknown:
            raise ConfigError(f"parallel.expert: unknown key(s) {unknown}; expected size, no_tp")
        par[EXPERT_KEY] = exp.get("size", -1)
        if "no_tp" in exp:
            compat.append("parallel.expert.no_tp")  # experts are never tensor-parallel here
    for key in ("expert_zero1", "expert_weight"):
        value: Optional[Any] = par.pop(key, None)
        if value is not None:
            compat.append(f"parallel.{key}")
