"""INTERNLM2: the InternLM transformer with grouped-query attention and no bias (InternLM2 / InternEvo)."""

from __future__ import annotations

from ..args import analytic_parameter_count, args_from_model_config, flops_per_token
from ..internlm.hf import LLAMA_HF
from ..internlm.counts import COUNTS
from ..internlm.model import Transformer
from ..internlm.parallelize import PLAN
from ..internlm.rules import bias_default, validate_transformer
from ..spec import ModelSpec, register_model
from .hf import INTERNEVO_CKPT, INTERNLM2_HF

# InternLM2's published shapes (internlm/internlm2-7b, -20b on Hugging Face)
SIZES = {
    "7B": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_kv_attention_heads=8,
               intermediate_size=14336, vocab_size=92544, rope_base=1e6),
    "20B": dict(num_layers=48, hidden_size=6144, num_attention_heads=48, num_kv_attention_heads=8,
                intermediate_size=16384, vocab_size=92544, rope_base=1e6),
}

SPEC = register_model(ModelSpec(
    name="INTERNLM2",
    aliases=("INTERNLM2_PUBLIC",),  # InternEvo's model_type for the same architecture
    description="InternLM2: grouped-query attention, no bias",
    module=Transformer,
    build_args=lambda inputs, attn_backend: args_from_model_config(inputs.model, inputs.seq_len, attn_backend),
    plan=PLAN,
    fill_defaults=bias_default(False),
    validate=lambda inputs: validate_transformer(inputs, grouped_query=True),
    num_parameters=analytic_parameter_count,
    flops_per_token=flops_per_token,
    counts=COUNTS,
    sizes=SIZES,
    adapters={"hf": INTERNLM2_HF, "hf_llama": LLAMA_HF, "internlm": INTERNEVO_CKPT},
))
