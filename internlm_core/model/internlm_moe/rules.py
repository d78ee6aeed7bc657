"""MoE families' args and config rules: the experts' settings from the `model` and `moe` sections."""

from __future__ import annotations

from ...errors import ConfigError
from ..args import args_from_model_config, ffn_width
from ..internlm.rules import refuse_keys, validate_transformer
from ..moe import MoEArgs, layer_mix_of
from ..spec import ModelInputs
from .model import MoEModelArgs

DROPLESS = ("Dropless", "MegaBlock-Dropless")
# `moe` keys only DEEPSEEK_V3 reads (its group-limited routing), with their defaults
GROUP_ROUTING = {"num_expert_groups": 1, "top_k_groups": 1, "routed_scaling_factor": 1.0}
CAPACITY = ("GShard", "MegaBlock")


def moe_args(inputs: ModelInputs) -> MoEArgs:
    """MoEArgs of `inputs` (model.num_experts / moe_type / moe_use_residual / moe_intermediate_size, the moe
    section, loss.moe_loss_coeff, the expert GEMM the run chose)."""
    m, r = inputs.model, inputs.moe
    return MoEArgs(num_experts=m.num_experts, top_k=r.top_k, ffn_width=m.moe_intermediate_size or ffn_width(m),
                   moe_type="Dropless" if m.moe_type in DROPLESS else "GShard",
                   capacity_factor=r.capacity_factor, eval_capacity_factor=r.eval_capacity_factor,
                   min_capacity=r.min_capacity, drop_tokens=r.drop_tokens, use_rts=r.use_rts,
                   noisy_gate_policy=r.noisy_gate_policy, score_func=r.score_func, norm_topk_prob=r.norm_topk_prob,
                   aux_loss_coeff=inputs.moe_loss_coeff, z_loss_coeff=r.z_loss_coeff,
                   expert_bias_update_rate=r.expert_bias_update_rate,
                   num_shared_experts=1 if m.moe_use_residual else 0, expert_gemm=inputs.expert_gemm)


def build_moe_args(inputs: ModelInputs, attn_backend: str) -> MoEModelArgs:
    """The dense args, the experts' (`moe_args`) and which blocks have them (model/moe/mix.py)."""
    dense = args_from_model_config(inputs.model, inputs.seq_len, attn_backend)
    return MoEModelArgs(**vars(dense), moe=moe_args(inputs), layer_mix=layer_mix_of(inputs.model))


def validate_moe(inputs: ModelInputs, grouped_query: bool) -> None:
    """The transformer's rules, and the experts': a count, a routing, a top_k they can serve, and the layouts the
    MoE layer runs under."""
    validate_transformer(inputs, grouped_query)
    refuse_keys(inputs.moe, "moe", GROUP_ROUTING, inputs.model_type, "DEEPSEEK_V3's group-limited routing")
    validate_moe_routing(inputs)


def validate_moe_routing(inputs: ModelInputs) -> None:
    """The experts' rules, whatever the attention: a count, a routing, a top_k they can serve, the dense blocks,
    and the layouts the MoE layer runs under."""
    m, r, p = inputs.model, inputs.moe, inputs.parallel
    if m.num_experts < 2:
        raise ConfigError(f"model.num_experts: model_type {inputs.model_type} needs 2 or more experts, got "
                          f"{m.num_experts}")
    if m.moe_type not in DROPLESS + CAPACITY:
        raise ConfigError(f"model.moe_type: expected one of {', '.join(CAPACITY + DROPLESS)}, got {m.moe_type!r}")
    layer_mix_of(m).check(m.num_layers)
    if not 1 <= r.top_k <= m.num_experts:
        raise ConfigError(f"moe.top_k ({r.top_k}) must be between 1 and model.num_experts ({m.num_experts})")
    if r.score_func not in ("softmax", "sigmoid"):
        raise ConfigError(f"moe.score_func: expected softmax or sigmoid, got {r.score_func!r}")
    if r.noisy_gate_policy not in (None, "Jitter", "RSample"):
        raise ConfigError(f"moe.noisy_gate_policy: expected None, 'Jitter' or 'RSample', got {r.noisy_gate_policy!r}")
    width = (m.moe_intermediate_size or ffn_width(m)) if m.moe_use_residual else 0
    if p.tensor > 1 and width % p.tensor:
        raise ConfigError(f"parallel.tensor ({p.tensor}) must divide the shared experts' width ({width}, "
                          "model.moe_intermediate_size): they are tensor-parallel like a dense FFN")
    ep = int(p.dims.get("expert", 1))
    if ep > 1 and m.num_experts % ep:
        raise ConfigError(f"parallel.expert ({ep}) must divide model.num_experts ({m.num_experts}): each "
                          f"expert-parallel rank holds num_experts / expert of them")
