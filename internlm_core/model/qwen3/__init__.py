"""QWEN3: Qwen3 (dense) on the InternLM transformer: grouped-query attention, q/k RMSNorm over each head before the
rotary embedding (`model.qk_norm`, on by default here), head_dim 128 at every width (`model.head_dim`), no bias,
rope base 1e6, tied embeddings up to 4B; Hugging Face class Qwen3ForCausalLM."""

from __future__ import annotations

from typing import Any

from ...errors import ConfigError
from ..args import analytic_parameter_count, args_from_model_config, flops_per_token
from ..internlm.counts import COUNTS
from ..internlm.model import Transformer
from ..internlm.parallelize import PLAN
from ..internlm.rules import validate_transformer
from ..spec import ModelInputs, ModelSpec, register_model
from .hf import QWEN3_HF

_Q = dict(rope_base=1e6, layer_norm_epsilon=1e-6, vocab_size=151936, head_dim=128, num_kv_attention_heads=8)
# Qwen's published shapes (Qwen/Qwen3-* config.json)
SIZES = {
    "0.6B": dict(_Q, num_layers=28, hidden_size=1024, num_attention_heads=16, intermediate_size=3072,
                 tie_word_embeddings=True),
    "1.7B": dict(_Q, num_layers=28, hidden_size=2048, num_attention_heads=16, intermediate_size=6144,
                 tie_word_embeddings=True),
    "4B": dict(_Q, num_layers=36, hidden_size=2560, num_attention_heads=32, intermediate_size=9728,
               tie_word_embeddings=True),
    "8B": dict(_Q, num_layers=36, hidden_size=4096, num_attention_heads=32, intermediate_size=12288),
    "14B": dict(_Q, num_layers=40, hidden_size=5120, num_attention_heads=40, intermediate_size=17408),
    "32B": dict(_Q, num_layers=64, hidden_size=5120, num_attention_heads=64, intermediate_size=25600),
}


def qwen3_defaults(m: Any) -> None:
    """Qwen3's defaults for unset keys: q/k norm on, no bias."""
    if m.qkv_bias is None:
        m.qkv_bias = False
    if m.qk_norm is None:
        m.qk_norm = True


def validate(inputs: ModelInputs) -> None:
    validate_transformer(inputs, grouped_query=True)
    if not inputs.model.qk_norm:
        raise ConfigError(f"model.qk_norm: model_type {inputs.model_type} normalizes q and k (Qwen3); use "
                          f"model_type LLAMA for a model without")


SPEC = register_model(ModelSpec(
    name="QWEN3",
    description="Qwen3: grouped-query attention, q/k norm, head_dim 128",
    module=Transformer,
    build_args=lambda inputs, attn_backend: args_from_model_config(inputs.model, inputs.seq_len, attn_backend),
    plan=PLAN, fill_defaults=qwen3_defaults, validate=validate,
    num_parameters=analytic_parameter_count, flops_per_token=flops_per_token, counts=COUNTS,
    sizes=SIZES, adapters={"hf": QWEN3_HF},
))
