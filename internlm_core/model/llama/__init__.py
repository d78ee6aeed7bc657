"""LLAMA: Llama / Llama 2 shapes on the InternLM transformer (grouped-query attention, no bias)."""

from __future__ import annotations

from ..args import analytic_parameter_count, args_from_model_config, flops_per_token
from ..internlm.counts import COUNTS
from ..internlm.model import Transformer
from ..internlm.parallelize import PLAN
from ..internlm.rules import bias_default, validate_transformer
from ..spec import ModelSpec, register_model
from .hf import ADAPTERS

# Meta's published shapes (Llama 2 paper, table 1 and the released configs)
SIZES = {
    "7B": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, intermediate_size=11008, vocab_size=32000),
    "13B": dict(num_layers=40, hidden_size=5120, num_attention_heads=40, intermediate_size=13824, vocab_size=32000),
    "70B": dict(num_layers=80, hidden_size=8192, num_attention_heads=64, num_kv_attention_heads=8,
                intermediate_size=28672, vocab_size=32000),
}

SPEC = register_model(ModelSpec(
    name="LLAMA",
    aliases=("LLAMA2",),  # InternEvo's name for the same architecture
    description="Llama / Llama 2: grouped-query attention, no bias",
    module=Transformer,
    build_args=lambda inputs, attn_backend: args_from_model_config(inputs.model, inputs.seq_len, attn_backend),
    plan=PLAN,
    fill_defaults=bias_default(False),
    validate=lambda inputs: validate_transformer(inputs, grouped_query=True),
    num_parameters=analytic_parameter_count,
    flops_per_token=flops_per_token,
    counts=COUNTS,
    sizes=SIZES,
    adapters=ADAPTERS,
))
