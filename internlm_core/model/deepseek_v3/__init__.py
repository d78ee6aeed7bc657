"""DEEPSEEK_V3: DeepSeek-V3's architecture, also Kimi-K2's and Moonlight's: multi-head latent attention (low-rank
queries and keys/values, decoupled rotary heads, YaRN), and an MoE stack whose first `first_k_dense_replace`
blocks are dense, its MoE layers routing by sigmoid scores, group-limited top-k, the aux-loss-free selection bias
(e_score_correction_bias), routed_scaling_factor and summed shared experts. Hugging Face class
DeepseekV3ForCausalLM (FP8 block-scaled folders are dequantized on import). Expert parallel, hooks and the
pipeline split are the MoE families'; tensor parallel adds latent attention's layout (parallelize.py)."""

from __future__ import annotations

from ..internlm_moe.hooks import MOE_HOOKS
from ..spec import ModelSpec, register_model
from .counts import COUNTS, flops_per_token, num_parameters
from .hf import DEEPSEEK_V3_HF
from .model import DeepSeekV3Args, DeepSeekV3Transformer, LatentAttentionArgs
from .parallelize import DEEPSEEK_PLAN
from .rules import build_deepseek_args, deepseek_defaults, validate_deepseek
from .sizes import SIZES

SPEC = register_model(ModelSpec(
    name="DEEPSEEK_V3", aliases=("DEEPSEEKV3", "KIMI_K2", "MOONLIGHT"),
    description="DeepSeek-V3 / Kimi-K2 / Moonlight: latent attention, group-limited sigmoid MoE with shared experts",
    module=DeepSeekV3Transformer, build_args=build_deepseek_args, plan=DEEPSEEK_PLAN,
    fill_defaults=deepseek_defaults, validate=validate_deepseek, num_parameters=num_parameters,
    sizes=SIZES, counts=COUNTS, flops_per_token=flops_per_token, adapters={"hf": DEEPSEEK_V3_HF}, hooks=MOE_HOOKS,
))

__all__ = ["DeepSeekV3Args", "DeepSeekV3Transformer", "LatentAttentionArgs", "SPEC"]
