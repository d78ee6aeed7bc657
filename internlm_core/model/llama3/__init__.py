"""LLAMA3: Llama 3 / 3.1 / 3.2 on the InternLM transformer: grouped-query attention, no bias, a 128K vocabulary,
rope base 500000 with Llama 3.1's frequency scaling (`model.rope_scaling`, rope_type "llama3"), tied embeddings
at 1B and 3B. Its Hugging Face class is LlamaForCausalLM (the shared Llama adapter carries rope_scaling)."""

from __future__ import annotations

from ..args import analytic_parameter_count, args_from_model_config, flops_per_token
from ..internlm.counts import COUNTS
from ..internlm.hf import LLAMA_HF
from ..internlm.model import Transformer
from ..internlm.parallelize import PLAN
from ..internlm.rules import bias_default, validate_transformer
from ..spec import ModelSpec, register_model

# Llama 3.1 / 3.2's rope scaling (their config.json)
LLAMA31_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
LLAMA32_ROPE = dict(LLAMA31_ROPE, factor=32.0)
_V3 = dict(vocab_size=128256, num_kv_attention_heads=8, rope_base=500000.0, layer_norm_epsilon=1e-5)

# Meta's published shapes (meta-llama/Llama-3.1-*, Llama-3.2-* config.json)
SIZES = {
    "1B": dict(_V3, num_layers=16, hidden_size=2048, num_attention_heads=32, intermediate_size=8192,
               tie_word_embeddings=True, rope_scaling=LLAMA32_ROPE),
    "3B": dict(_V3, num_layers=28, hidden_size=3072, num_attention_heads=24, intermediate_size=8192,
               tie_word_embeddings=True, rope_scaling=LLAMA32_ROPE),
    "8B": dict(_V3, num_layers=32, hidden_size=4096, num_attention_heads=32, intermediate_size=14336,
               rope_scaling=LLAMA31_ROPE),
    "70B": dict(_V3, num_layers=80, hidden_size=8192, num_attention_heads=64, intermediate_size=28672,
                rope_scaling=LLAMA31_ROPE),
    "405B": dict(_V3, num_layers=126, hidden_size=16384, num_attention_heads=128, intermediate_size=53248,
                 rope_scaling=LLAMA31_ROPE),
}

SPEC = register_model(ModelSpec(
    name="LLAMA3",
    aliases=("LLAMA3_1", "LLAMA3_2"),
    description="Llama 3: grouped-query attention, no bias, 128K vocabulary, llama3 rope scaling",
    module=Transformer,
    build_args=lambda inputs, attn_backend: args_from_model_config(inputs.model, inputs.seq_len, attn_backend),
    plan=PLAN,
    fill_defaults=bias_default(False),
    validate=lambda inputs: validate_transformer(inputs, grouped_query=True),
    num_parameters=analytic_parameter_count,
    flops_per_token=flops_per_token,
    counts=COUNTS,
    sizes=SIZES,
    adapters={"hf": LLAMA_HF, "hf_llama": LLAMA_HF},
))
