"""The keys a Hugging Face folder's config.json fixes, as a family adapter's `config_from_foreign` returns them
(our `model` keys, `top_k`, and dotted `moe.*` keys), and how a run's value of each is found and compared: in the
config's `model` / `moe` sections (config/hf_folder.py takes the folder's values into a run's config) and in a
built model's ModelArgs (checkpoint/hf.py refuses a model that differs). Plain values only: no config, no torch."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from .args import ffn_width

# our key -> the config.json keys that hold it, the first one present names it in messages
_FOLDER_NAMES = {
    "num_layers": ("num_hidden_layers",), "num_kv_attention_heads": ("num_key_value_heads",),
    "layer_norm_epsilon": ("rms_norm_eps",), "rope_base": ("rope_parameters.rope_theta", "rope_theta", "rotary.base"),
    "rope_scaling": ("rope_parameters", "rope_scaling"), "qkv_bias": ("attention_bias", "bias"),
    "sliding_window": ("sliding_window", "use_sliding_window"), "window_layers": ("layer_types", "max_window_layers"),
    "num_experts": ("num_local_experts", "num_experts"),
    "top_k": ("num_experts_per_tok",), "moe_intermediate_size": ("moe_intermediate_size", "intermediate_size"),
    "moe.norm_topk_prob": ("norm_topk_prob",), "moe.noisy_gate_policy": ("router_jitter_noise",),
    "mtp": ("num_nextn_predict_layers",),
}
# our key -> ModelArgs attribute (MoE keys: of ModelArgs.moe, MoEArgs)
_ARGS = {"num_attention_heads": "num_heads", "num_kv_attention_heads": "num_kv_heads", "intermediate_size": "ffn_width",
         "layer_norm_epsilon": "norm_eps"}
_MOE_ARGS = {"num_experts": "num_experts", "top_k": "top_k", "moe_intermediate_size": "ffn_width",
             "moe_type": "moe_type"}
# the keys of which blocks are MoE (model/moe/mix.py's MIX_KEYS; this module imports no torch)
_MIX = ("first_k_dense_replace", "decoder_sparse_step", "mlp_only_layers")
# our key -> the config keys that, set by the user, fix its value (derived values: the FFN width, kv heads)
_SET_BY = {"intermediate_size": ("model.intermediate_size", "model.mlp_ratio", "model.multiple_of"),
           "top_k": ("moe.top_k",)}


def config_key(key: str) -> str:
    """The dotted config key of an adapter key: `rope_base` -> `model.rope_base`, `top_k` -> `moe.top_k`."""
    return key if "." in key else ("moe.top_k" if key == "top_k" else f"model.{key}")


def set_by(key: str) -> tuple[str, ...]:
    """The dotted config keys whose explicit setting fixes `key`'s run value."""
    return _SET_BY.get(key, (config_key(key),))


def folder_name(key: str, c: Mapping[str, Any], arch: str = "") -> str:
    """The config.json key that holds `key` in `c` (`rope_parameters.rope_theta`, `rms_norm_eps`, ...); a key no
    entry holds is implied by the class (`Qwen2ForCausalLM's qkv_bias`)."""
    for name in _FOLDER_NAMES.get(key, (key,)):
        node: Any = c
        for part in name.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if node is not None:
            return name
    return f"{arch or 'the class'}'s {key.split('.')[-1]}"


def run_value(key: str, m: Any, moe: Any) -> Any:
    """A run's value of `key` from its config sections (`model` m, `moe`), defaults resolved as the model does."""
    if key == "intermediate_size":
        return ffn_width(m)
    if key == "moe_intermediate_size":
        return m.moe_intermediate_size or ffn_width(m)
    if key == "head_dim":
        return m.head_dim or m.hidden_size // m.num_attention_heads
    if key == "num_kv_attention_heads":
        return m.num_kv_attention_heads or m.num_attention_heads
    if key in ("qkv_bias", "qk_norm", "tie_word_embeddings"):
        return bool(getattr(m, key))
    if key == "mlp_only_layers":
        return sorted(m.mlp_only_layers or [])
    if key == "mtp":  # model.mtp: its depth is what the folder fixes (loss_weight is the run's)
        return mtp_depth(m.mtp)
    if key == "top_k" or key.startswith("moe."):
        return getattr(moe, key.split(".")[-1])  # a typed field of the `moe` section
    return getattr(m, key)  # a typed field of the `model` section (an adapter's key names one)


def set_run_value(key: str, m: Any, moe: Any, value: Any) -> None:
    """Set `key` in the config sections so that `run_value` gives `value`."""
    if key == "top_k" or key.startswith("moe."):
        setattr(moe, key.split(".")[-1], value)
    else:
        setattr(m, key, value)


def args_value(key: str, args: Any) -> Any:
    """A built model's value of `key` (its ModelArgs; the MoE keys from `args.moe`, None for a dense model)."""
    if key in _MOE_ARGS or key.startswith("moe.") or key == "moe_use_residual":
        moe = getattr(args, "moe", None)  # MoEModelArgs.moe; a dense family's ModelArgs has none
        if moe is None:
            return None
        if key == "moe_use_residual":
            return moe.num_shared_experts > 0
        return getattr(moe, _MOE_ARGS.get(key, key.split(".")[-1]), None)
    if key in _MIX:  # MoEModelArgs.layer_mix (model/moe/mix.py); None for a dense model
        mix = getattr(args, "layer_mix", None)
        return None if mix is None else (sorted(mix.mlp_only_layers) if key == "mlp_only_layers" else
                                         getattr(mix, key))
    if key == "mtp":
        return getattr(args, "mtp_depth", 0)  # a family's args without the field build no depths
    value = getattr(args, _ARGS.get(key, key), None)
    return bool(value) if key in ("qkv_bias", "qk_norm", "tie_word_embeddings") else value


def same(key: str, ours: Any, theirs: Any) -> bool:
    """Whether a run's value and a folder's value of `key` build the same model."""
    if key == "rope_scaling":
        return _scaling(ours) == _scaling(theirs)
    if key == "moe_type":
        return _dropless(ours) == _dropless(theirs)
    if key == "mlp_only_layers":  # None or a list in the config, a tuple in ModelArgs: block indices as a set
        return sorted(ours or []) == sorted(theirs or [])
    if key == "window_layers":  # a list in the config, a tuple in ModelArgs
        return (None if ours is None else sorted(ours)) == (None if theirs is None else sorted(theirs))
    if key == "mtp":
        return mtp_depth(ours) == mtp_depth(theirs)
    if key == "moe.noisy_gate_policy":
        return (None if ours in (None, "None") else ours) == (None if theirs in (None, "None") else theirs)
    if isinstance(ours, (int, float)) and isinstance(theirs, (int, float)) and not isinstance(ours, bool):
        return float(ours) == float(theirs)
    return ours == theirs


def mtp_depth(value: Any) -> int:
    """The depth of a model.mtp value (None / 0 / False: 0, an int, or a dict's depth, 1 by default)."""
    if isinstance(value, Mapping):
        return int(value.get("depth", 1))
    return 0 if value in (None, False) else int(value)


def _dropless(moe_type: Any) -> bool:
    return "dropless" in str(moe_type).lower()


def _scaling(scaling: Optional[Mapping[str, Any]]) -> Optional[dict]:
    """A rope_scaling dict in one spelling (None: no scaling)."""
    if not scaling or str(scaling.get("rope_type") or scaling.get("type") or "default") == "default":
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    return {"kind": kind, **{k: float(v) if isinstance(v, (int, float)) else v for k, v in scaling.items()
                             if k not in ("type", "rope_type", "rope_theta") and v is not None}}


def differences(keys: Mapping[str, Any], value_of: Any, c: Mapping[str, Any], arch: str,
                skip: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(key, "config.json's name=value vs model.key=value") of every adapter key whose run value (`value_of(key)`)
    differs from the folder's, but those whose dotted config key is in `skip`."""
    out = []
    for key, theirs in keys.items():
        ours = value_of(key)
        if config_key(key) in skip or same(key, ours, theirs):
            continue
        out.append((key, f"{folder_name(key, c, arch)}={theirs!r} vs {config_key(key)}={ours!r}"))
    return out
