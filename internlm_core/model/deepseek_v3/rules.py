"""DEEPSEEK_V3's args and config rules: the latent attention's shape, DeepSeek's routing, and what the layouts
need."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ...errors import ConfigError
from ..internlm.rules import validate_block_options
from ..internlm_moe.rules import build_moe_args, validate_moe_routing
from ..layers import rope_scaling_kind
from ..spec import ModelInputs
from .model import DeepSeekV3Args, LatentAttentionArgs

def deepseek_defaults(m: Any) -> None:
    """DeepSeek's defaults for unset keys: no bias; one key/value head per query head (MLA has no groups)."""
    if m.qkv_bias is None:
        m.qkv_bias = False
    if m.qk_norm is None:
        m.qk_norm = False


def softmax_scale_factor(scaling: Any) -> float:
    """mscale^2 of YaRN's mscale_all_dim (transformers' yarn_apply_mscale: 0.1 * mscale_all_dim * ln(factor) + 1,
    squared, for a factor > 1), the factor MLA's softmax scale gets beyond (nope + rope)^-0.5; 1.0 otherwise."""
    if rope_scaling_kind(scaling) == "default" or not scaling.get("mscale_all_dim"):
        return 1.0
    factor = float(scaling["factor"])
    mscale = 1.0 if factor <= 1 else 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0
    return mscale * mscale


def build_deepseek_args(inputs: ModelInputs, attn_backend: str) -> DeepSeekV3Args:
    """The MoE args (DeepSeek's routing options of the `moe` section, the shared experts summed, the selection
    bias always kept: a loaded e_score_correction_bias routes even when it is not updated) and the latent
    attention's; the rotary tables cover qk_rope_head_dim channels."""
    m = inputs.model
    moe = build_moe_args(inputs, attn_backend)
    mla = LatentAttentionArgs(q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                              qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
                              v_head_dim=m.v_head_dim, softmax_scale_factor=softmax_scale_factor(m.rope_scaling))
    r = inputs.moe
    routing = dataclasses.replace(moe.moe, num_shared_experts=m.num_shared_experts, shared_expert_mix="sum",
                                  expert_bias=True, num_expert_groups=r.num_expert_groups,
                                  top_k_groups=r.top_k_groups, routed_scaling_factor=r.routed_scaling_factor)
    fields = {**vars(moe), "moe": routing, "attention_head_dim": m.qk_rope_head_dim,
              "num_kv_heads": m.num_attention_heads}
    return DeepSeekV3Args(**fields, mla=mla)


def _positive(m: Any, key: str, even: bool = False) -> None:
    value = getattr(m, key)  # a typed field of the `model` section named by key
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (even and value % 2):
        raise ConfigError(f"model.{key}: model_type DEEPSEEK_V3 needs an {'even ' if even else ''}int >= 1 "
                          f"(multi-head latent attention), got {value!r}")


def validate_deepseek(inputs: ModelInputs) -> None:
    """MLA's keys, the block options it has (rope scaling; no q/k norm, window or bias), the MoE rules and
    DeepSeek's routing, and the layouts: tensor parallel splits the heads, the dense FFN and the shared experts."""
    m = inputs.model
    for key in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        _positive(m, key)
    _positive(m, "qk_rope_head_dim", even=True)
    if m.q_lora_rank is not None:
        _positive(m, "q_lora_rank")
    validate_block_options(inputs)
    for key, value in (("qkv_bias", m.qkv_bias), ("qk_norm", m.qk_norm), ("sliding_window", m.sliding_window),
                       ("apply_post_layer_norm", m.apply_post_layer_norm), ("moe_use_residual", m.moe_use_residual),
                       ("head_dim", m.head_dim)):
        if value:
            raise ConfigError(f"model.{key}={value!r}: model_type DEEPSEEK_V3 has no such option (latent "
                              f"attention without bias, q/k norm or window; pre-norm; shared experts are "
                              f"model.num_shared_experts, summed; the head dims are qk_nope_head_dim + "
                              f"qk_rope_head_dim and v_head_dim)")
    if m.num_kv_attention_heads not in (None, m.num_attention_heads):
        raise ConfigError(f"model.num_kv_attention_heads ({m.num_kv_attention_heads}): latent attention expands "
                          f"keys and values for every query head; leave it unset or {m.num_attention_heads}")
    if m.norm_type != "rmsnorm":
        raise ConfigError(f"model.norm_type: only 'rmsnorm' is supported, got {m.norm_type!r}")
    if isinstance(m.num_shared_experts, bool) or not isinstance(m.num_shared_experts, int) or m.num_shared_experts < 0:
        raise ConfigError(f"model.num_shared_experts: expected an int >= 0, got {m.num_shared_experts!r}")
    validate_moe_routing(inputs)
    _validate_layout(inputs)
    build_deepseek_args(inputs, "sdpa")  # MoEArgs' own checks (moe.num_expert_groups, top_k_groups, ...)


def _validate_layout(inputs: ModelInputs) -> None:
    m, p = inputs.model, inputs.parallel
    if p.pipeline > 1 and m.tie_word_embeddings:
        raise ConfigError("model.tie_word_embeddings: not supported with parallel.pipeline > 1 "
                          "(the embedding and the output live on different stages)")
    if p.tensor > 1:
        widths = {"model.num_attention_heads": m.num_attention_heads,
                  "the dense FFN width (model.intermediate_size)": m.intermediate_size or 0,
                  "the shared experts' width (num_shared_experts * moe_intermediate_size)":
                      m.num_shared_experts * (m.moe_intermediate_size or 0)}
        for what, width in widths.items():
            if width % p.tensor:
                raise ConfigError(f"parallel.tensor ({p.tensor}) must divide {what} ({width}): latent attention "
                                  "splits its heads, the dense and shared FFNs their columns")
        if p.sequence_parallel and inputs.seq_len % p.tensor:
            raise ConfigError(f"parallel.sequence_parallel: data.seq_len ({inputs.seq_len}) must be divisible by "
                              f"parallel.tensor ({p.tensor})")
