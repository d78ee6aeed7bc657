"""Mixture of experts: the MoE feed-forward layer (router, capacity, dispatch, experts, auxiliary losses).

    layer = MoEFeedForward(hidden_size, MoEArgs(num_experts=8, top_k=2, ffn_width=...))
    layer.set_expert_parallel(group, ep_size, ep_rank)   # optional: experts split over ranks, tokens all-to-all
    set_aux_loss_scale(grad_scale / micro_num)           # before each backward: d(loss)/d(aux_total)
    update_expert_bias(model, dp_group)                  # after each step when expert_bias_update_rate > 0

Self-contained: imports torch and the shared model layers only (no config, distributed or parallel package).
"""

from .args import MoEArgs
from .aux_loss import aux_loss_scale, set_aux_loss_scale
from .balance import moe_layers, update_expert_bias
from .dispatch import pop_all_to_all_bytes
from .experts import grouped_mm_available
from .layer import MoEFeedForward
from .router import Routing, route
from .stats import MoEStats

__all__ = ["MoEArgs", "MoEFeedForward", "MoEStats", "Routing", "aux_loss_scale", "grouped_mm_available",
           "moe_layers", "pop_all_to_all_bytes", "route", "set_aux_loss_scale", "update_expert_bias"]
