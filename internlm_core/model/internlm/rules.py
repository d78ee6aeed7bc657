"""Config rules of the InternLM transformer families: defaults for unset keys and what must hold together."""

from __future__ import annotations

from typing import Any

from ...errors import ConfigError
from ..args import ffn_width
from ..spec import ModelInputs


def validate_transformer(inputs: ModelInputs, grouped_query: bool) -> None:
    """Shape rules of the transformer (heads, rotary, norms) and of its tensor/pipeline parallel plan."""
    m, p = inputs.model, inputs.parallel
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"model.num_attention_heads ({m.num_attention_heads}) must divide model.hidden_size "
                          f"({m.hidden_size}): each head gets hidden_size / num_attention_heads channels")
    if (m.hidden_size // m.num_attention_heads) % 2:
        raise ConfigError(f"model.hidden_size / model.num_attention_heads = {m.hidden_size // m.num_attention_heads} "
                          f"must be even for rotary embeddings")
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
