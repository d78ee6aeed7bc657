"""INTERNLM (v1): the InternLM transformer with bias on q/k/v/o and no grouped-query attention."""

from __future__ import annotations

from ..args import analytic_parameter_count, args_from_model_config, flops_per_token
from ..spec import ModelSpec, register_model
from .counts import COUNTS
from .hf import INTERNLM_HF, LLAMA_HF
from .internlm_ckpt import INTERNLM_CKPT
from .model import Transformer
from .parallelize import PLAN
from .rules import bias_default, validate_transformer

# InternLM's published shapes (InternLM/InternLM configs; vocabulary of its V7 tokenizer)
SIZES = {
    "7B": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, vocab_size=103168, mlp_ratio=8 / 3),
    "20B": dict(num_layers=60, hidden_size=5120, num_attention_heads=40, vocab_size=103168, mlp_ratio=8 / 3),
}

SPEC = register_model(ModelSpec(
    name="INTERNLM",
    description="InternLM v1: RMSNorm, rotary, SwiGLU, bias on q/k/v/o, multi-head attention",
    module=Transformer,
    build_args=lambda inputs, attn_backend: args_from_model_config(inputs.model, inputs.seq_len, attn_backend),
    plan=PLAN,
    fill_defaults=bias_default(True),
    validate=lambda inputs: validate_transformer(inputs, grouped_query=False),
    num_parameters=analytic_parameter_count,
    flops_per_token=flops_per_token,
    counts=COUNTS,
    sizes=SIZES,
    adapters={"hf": INTERNLM_HF, "hf_llama": LLAMA_HF, "internlm": INTERNLM_CKPT},
))
