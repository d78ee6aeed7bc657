"""MISTRAL: Mistral on the InternLM transformer: grouped-query attention, no bias, sliding-window attention
(`model.sliding_window`, in every attention kernel's document mask); Hugging Face class MistralForCausalLM."""

from __future__ import annotations

from ...errors import ConfigError
from ..args import analytic_parameter_count, args_from_model_config, flops_per_token
from ..internlm.counts import COUNTS
from ..internlm.model import Transformer
from ..internlm.parallelize import PLAN
from ..internlm.rules import bias_default, validate_transformer
from ..spec import ModelInputs, ModelSpec, register_model
from .hf import MISTRAL_HF

_M = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_kv_attention_heads=8, intermediate_size=14336)
# Mistral AI's published shapes (mistralai/Mistral-7B-v0.1, -v0.3, Mistral-Nemo-Base-2407 config.json)
SIZES = {
    "7B": dict(_M, vocab_size=32000, rope_base=10000.0, sliding_window=4096),
    "7B_v0.3": dict(_M, vocab_size=32768, rope_base=1e6),
    "12B_Nemo": dict(_M, num_layers=40, hidden_size=5120, head_dim=128, vocab_size=131072, rope_base=1e6),
}


def validate(inputs: ModelInputs) -> None:
    validate_transformer(inputs, grouped_query=True)
    if inputs.model.qkv_bias:
        raise ConfigError("model.qkv_bias: model_type MISTRAL has no attention bias (MistralForCausalLM)")


SPEC = register_model(ModelSpec(
    name="MISTRAL",
    description="Mistral: grouped-query attention, no bias, sliding-window attention",
    module=Transformer,
    build_args=lambda inputs, attn_backend: args_from_model_config(inputs.model, inputs.seq_len, attn_backend),
    plan=PLAN, fill_defaults=bias_default(False), validate=validate,
    num_parameters=analytic_parameter_count, flops_per_token=flops_per_token, counts=COUNTS,
    sizes=SIZES, adapters={"hf": MISTRAL_HF},
))
