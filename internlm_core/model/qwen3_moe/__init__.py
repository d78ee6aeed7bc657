"""QWEN3_MoE: Qwen3-MoE on the MoE transformer (internlm_moe/): Qwen3's attention (grouped-query, q/k norm,
head_dim 128, no bias) and a dropless softmax top-k mixture of experts in every block, no shared experts;
Hugging Face class Qwen3MoeForCausalLM. Expert parallel, counts, hooks and plan are the MoE families'."""

from __future__ import annotations

from ...errors import ConfigError
from ..internlm_moe.counts import COUNTS, flops_per_token
from ..internlm_moe.hooks import MOE_HOOKS
from ..internlm_moe.model import MoETransformer
from ..internlm_moe.parallelize import MOE_PLAN
from ..internlm_moe.rules import build_moe_args, validate_moe
from ..qwen3 import qwen3_defaults
from ..spec import ModelInputs, ModelSpec, register_model
from .hf import QWEN3_MOE_HF

_Q = dict(rope_base=1e6, layer_norm_epsilon=1e-6, vocab_size=151936, head_dim=128, num_kv_attention_heads=4,
          num_experts=128, top_k=8, moe_type="Dropless")
# Qwen's published shapes (Qwen/Qwen3-30B-A3B, Qwen3-235B-A22B config.json); moe.norm_topk_prob True in both
SIZES = {
    "30B_A3B": dict(_Q, num_layers=48, hidden_size=2048, num_attention_heads=32, intermediate_size=6144,
                    moe_intermediate_size=768),
    "235B_A22B": dict(_Q, num_layers=94, hidden_size=4096, num_attention_heads=64, intermediate_size=12288,
                      moe_intermediate_size=1536),
}


def validate(inputs: ModelInputs) -> None:
    validate_moe(inputs, grouped_query=True)
    if not inputs.model.qk_norm:
        raise ConfigError(f"model.qk_norm: model_type {inputs.model_type} normalizes q and k (Qwen3); use "
                          "model_type MIXTRAL for a model without")


SPEC = register_model(ModelSpec(
    name="QWEN3_MoE", aliases=("QWEN3_MOE",),
    description="Qwen3-MoE: Qwen3's attention with a dropless mixture-of-experts FFN",
    module=MoETransformer, build_args=build_moe_args, plan=MOE_PLAN,
    fill_defaults=qwen3_defaults, validate=validate,
    sizes=SIZES, counts=COUNTS, flops_per_token=flops_per_token, adapters={"hf": QWEN3_MOE_HF}, hooks=MOE_HOOKS,
))
