"""QWEN2: Qwen2 / Qwen2.5 on the InternLM transformer: grouped-query attention with a bias on q, k and v (none on
o), rope base 1e6, tied embeddings up to 3B; Hugging Face class Qwen2ForCausalLM."""

from __future__ import annotations

from dataclasses import replace

from ...errors import ConfigError
from ..args import ModelArgs, analytic_parameter_count, args_from_model_config, flops_per_token
from ..internlm.counts import COUNTS
from ..internlm.model import Transformer
from ..internlm.parallelize import PLAN
from ..internlm.rules import bias_default, validate_transformer
from ..spec import ModelInputs, ModelSpec, register_model
from .hf import QWEN2_HF

_Q = dict(rope_base=1e6, layer_norm_epsilon=1e-6, vocab_size=151936)
# Qwen's published shapes (Qwen/Qwen2.5-* config.json)
SIZES = {
    "0.5B": dict(_Q, num_layers=24, hidden_size=896, num_attention_heads=14, num_kv_attention_heads=2,
                 intermediate_size=4864, tie_word_embeddings=True),
    "1.5B": dict(_Q, num_layers=28, hidden_size=1536, num_attention_heads=12, num_kv_attention_heads=2,
                 intermediate_size=8960, tie_word_embeddings=True),
    "3B": dict(_Q, num_layers=36, hidden_size=2048, num_attention_heads=16, num_kv_attention_heads=2,
               intermediate_size=11008, tie_word_embeddings=True),
    "7B": dict(_Q, num_layers=28, hidden_size=3584, num_attention_heads=28, num_kv_attention_heads=4,
               intermediate_size=18944, vocab_size=152064),
    "14B": dict(_Q, num_layers=48, hidden_size=5120, num_attention_heads=40, num_kv_attention_heads=8,
                intermediate_size=13824, vocab_size=152064),
    "32B": dict(_Q, num_layers=64, hidden_size=5120, num_attention_heads=40, num_kv_attention_heads=8,
                intermediate_size=27648, vocab_size=152064),
    "72B": dict(_Q, num_layers=80, hidden_size=8192, num_attention_heads=64, num_kv_attention_heads=8,
                intermediate_size=29568, vocab_size=152064),
}


def build_args(inputs: ModelInputs, attn_backend: str) -> ModelArgs:
    """The shared args with o's bias off (Qwen2 biases q, k and v only)."""
    return replace(args_from_model_config(inputs.model, inputs.seq_len, attn_backend), out_bias=False)


def validate(inputs: ModelInputs) -> None:
    validate_transformer(inputs, grouped_query=True)
    if not inputs.model.qkv_bias:
        raise ConfigError("model.qkv_bias: model_type QWEN2 has a bias on q, k and v (Qwen2ForCausalLM has no "
                          "switch for it); use model_type LLAMA for a model without")


SPEC = register_model(ModelSpec(
    name="QWEN2",
    aliases=("QWEN2_5", "QWEN2.5"),
    description="Qwen2 / Qwen2.5: grouped-query attention, bias on q/k/v only",
    module=Transformer, build_args=build_args, plan=PLAN,
    fill_defaults=bias_default(True), validate=validate,
    num_parameters=analytic_parameter_count, flops_per_token=flops_per_token, counts=COUNTS,
    sizes=SIZES, adapters={"hf": QWEN2_HF},
))
