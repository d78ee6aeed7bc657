"""Config rules of the InternLM transformer families: defaults for unset keys and what must hold together."""

from __future__ import annotations

from typing import Any, Mapping

from ...errors import ConfigError
from ..args import ffn_width
from ..layers import ROPE_SCALINGS, rope_scaling_kind
from ..spec import ModelInputs


# `model` keys only the latent-attention family (DEEPSEEK_V3, model/deepseek_v3) reads, with their defaults
LATENT_KEYS = {"q_lora_rank": None, "kv_lora_rank": None, "qk_nope_head_dim": None, "qk_rope_head_dim": None,
               "v_head_dim": None, "num_shared_experts": 0}


def refuse_keys(section: Any, name: str, keys: Mapping[str, Any], model_type: str, owner: str) -> None:
    """ConfigError for a key of `keys` set to other than its default in `section` (`name`: "model", "moe"): a
    key `model_type` does not read, which only `owner` does."""
    for key, default in keys.items():
        value = getattr(section, key)  # the typed field named by `key` (every key of `keys` is one)
        if value != default:
            raise ConfigError(f"{name}.{key}={value!r}: model_type {model_type} has no such option ({owner} "
                              f"reads it); leave it at {default!r}")


def validate_transformer(inputs: ModelInputs, grouped_query: bool) -> None:
    """Shape rules of the transformer (heads, rotary, norms) and of its tensor/pipeline parallel plan."""
    m, p = inputs.model, inputs.parallel
    refuse_keys(m, "model", LATENT_KEYS, inputs.model_type, "DEEPSEEK_V3's latent attention and shared experts")
    head_dim = m.head_dim
    if head_dim is None and m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"model.num_attention_heads ({m.num_attention_heads}) must divide model.hidden_size "
                          f"({m.hidden_size}): each head gets hidden_size / num_attention_heads channels "
                          "(or set model.head_dim)")
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2):
        raise ConfigError(f"model.head_dim: expected an even int >= 2 (rotary embeddings rotate pairs), got "
                          f"{head_dim!r}")
    if (m.hidden_size // m.num_attention_heads) % 2 and head_dim is None:
        raise ConfigError(f"model.hidden_size / model.num_attention_heads = {m.hidden_size // m.num_attention_heads} "
                          f"must be even for rotary embeddings")
    validate_block_options(inputs)
    if m.num_kv_attention_heads < 1 or m.num_attention_heads % m.num_kv_attention_heads:
        raise ConfigError(f"model.num_kv_attention_heads ({m.num_kv_attention_heads}) must divide "
                          f"model.num_attention_heads ({m.num_attention_heads}) for grouped-query attention")
    if not grouped_query and m.num_kv_attention_heads != m.num_attention_heads:
        raise ConfigError(f"model.num_kv_attention_heads: model_type {inputs.model_type} has no grouped-query "
                          "attention; use model_type INTERNLM2 or LLAMA")
    if m.norm_type != "rmsnorm":
        raise ConfigError(f"model.norm_type: only 'rmsnorm' is supported, got {m.norm_type!r}")
    if p.pipeline > 1 and m.tie_word_embeddings:
        raise ConfigError("model.tie_word_embeddings: not supported with parallel.pipeline > 1 "
                          "(the embedding and the output live on different stages)")
    if p.tensor > 1:
        if m.num_attention_heads % p.tensor or m.num_kv_attention_heads % p.tensor:
            raise ConfigError(f"parallel.tensor ({p.tensor}) must divide model.num_attention_heads "
                              f"({m.num_attention_heads}) and model.num_kv_attention_heads ({m.num_kv_attention_heads})")
        if ffn_width(m) % p.tensor:
            raise ConfigError(f"parallel.tensor ({p.tensor}) must divide the FFN width ({ffn_width(m)})")
        if p.sequence_parallel and inputs.seq_len % p.tensor:
            raise ConfigError(f"parallel.sequence_parallel: data.seq_len ({inputs.seq_len}) must be divisible by "
                              f"parallel.tensor ({p.tensor})")


def bias_default(value: bool) -> Any:
    """fill_defaults for a family whose q/k/v/o bias defaults to `value`."""
    def fill(m: Any) -> None:
        if m.qkv_bias is None:
            m.qkv_bias = value
    return fill


_ROPE_KEYS = {"linear": ("factor",), "dynamic": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
              "yarn": ("factor", "original_max_position_embeddings")}


def validate_rope_scaling(scaling: Any) -> None:
    """model.rope_scaling: None or a dict of a kind the rotary tables compute, with its numbers."""
    if scaling is None:
        return
    if not isinstance(scaling, Mapping):
        raise ConfigError(f"model.rope_scaling: expected None or a dict such as dict(type='linear', factor=2.0), "
                          f"got {scaling!r}")
    kind = rope_scaling_kind(scaling)
    if kind == "default":
        return
    if kind not in _ROPE_KEYS:
        raise ConfigError(f"model.rope_scaling: type {kind!r} is not implemented; expected one of "
                          f"{', '.join(ROPE_SCALINGS)} (or None)")
    for key in _ROPE_KEYS[kind] + (("original_max_position_embeddings",) if kind == "dynamic" else ()):
        value = scaling.get(key)
        if value is None and kind == "dynamic" and key != "factor":
            continue  # dynamic NTK without an original length: none beyond the training length
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"model.rope_scaling: {kind} scaling needs {key} > 0, got {value!r}")
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ConfigError(f"model.rope_scaling: llama3 scaling needs high_freq_factor > low_freq_factor, got "
                          f"{scaling['high_freq_factor']} and {scaling['low_freq_factor']}")


def validate_block_options(inputs: ModelInputs) -> None:
    """The shared block's options (model.rope_scaling, model.sliding_window, model.qk_norm)."""
    m = inputs.model
    validate_rope_scaling(m.rope_scaling)
    window = m.sliding_window
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ConfigError(f"model.sliding_window: expected None or an int >= 1 (keys per query), got {window!r}")
    layers = m.window_layers
    if layers is not None and (window is None or not isinstance(layers, (list, tuple)) or
                               any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < m.num_layers
                                   for i in layers)):
        raise ConfigError(f"model.window_layers: expected None or a list of layer indices in [0, {m.num_layers}) "
                          f"with model.sliding_window set, got {layers!r} (sliding_window {window!r})")
    if not isinstance(m.qk_norm, (bool, type(None))):
        raise ConfigError(f"model.qk_norm: expected True or False, got {m.qk_norm!r}")
