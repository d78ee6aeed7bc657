"""Mixture of experts: the MoE feed-forward layer (router, capacity, dispatch, experts, auxiliary losses).

    layer = MoEFeedForward(hidden_size, MoEArgs(num_experts=8, top_k=2, ffn_width=...))
    layer.set_expert_parallel(group, ep_size, ep_rank)   # optional: experts split over ranks, tokens all-to-all
    set_aux_loss_scale(grad_scale / micro_num)           # before each backward: d(loss)/d(aux_total)
    update_expert_bias(model, dp_group)                  # after each step when expert_bias_update_rate > 0
    LayerMix(first_k_dense_replace=3).is_moe(i)          # which blocks of a stack are MoE (mix.py: how to use it)

Self-contained: imports torch and the shared model layers only (no config, distributed or parallel package).
"""

from .args import MoEArgs
from .aux_loss import aux_loss_scale, set_aux_loss_scale
from .balance import moe_layers, update_expert_bias
from .dispatch import pop_all_to_all_bytes
from .experts import grouped_mm_available
from .layer import MoEFeedForward
from .mix import MIX_KEYS, LayerMix, layer_mix_of
from .router import Routing, route
from .stats import MoEStats

__all__ = ["LayerMix", "MIX_KEYS", "MoEArgs", "MoEFeedForward", "MoEStats", "Routing", "aux_loss_scale",
           "grouped_mm_available", "layer_mix_of", "moe_layers", "pop_all_to_all_bytes", "route",
           "set_aux_loss_scale", "update_expert_bias"]
