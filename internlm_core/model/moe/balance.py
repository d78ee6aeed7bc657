"""Aux-loss-free load balancing (DeepSeek-V3) over a whole model, and finding a model's MoE layers.

After each optimizer step the trainer calls `update_expert_bias(model, group)`: every MoE layer with
expert_bias_update_rate > 0 moves its `gate.expert_bias` by rate * sign(mean_load - load), where load is the
(token, choice) pairs its router sent to each expert in training since the previous call (all micro-batches of the
step). The bias only shifts the selection (router.py), never the weights, so this runs outside autograd.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ...utils import collectives
from .layer import MoEFeedForward
from .router import local_tensor


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """Every MoEFeedForward of `model`, in `modules()` order."""
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


@torch.no_grad()
def update_expert_bias(model: nn.Module, group: Optional[dist.ProcessGroup] = None) -> None:
    """One bias step for every bias-balanced MoE layer of `model` from the loads since the last call.

    `group`: the ranks whose loads are summed first (one all-reduce for all layers), so that every replica of a
    layer moves its bias identically: the data-parallel ranks holding the same layers (under pipeline parallel not
    the whole world, whose stages hold different layers). None: this rank's loads only (one process).
    """
    layers = [m for m in moe_layers(model) if m.gate.expert_bias is not None and m.args.expert_bias_update_rate > 0]
    if not layers:
        return
    loads = []
    for m in layers:
        load = m.take_load()
        loads.append(load if load is not None else torch.zeros_like(m.gate.expert_bias, dtype=torch.float32))
    stacked = torch.stack([load.to(layers[0].gate.expert_bias.device) for load in loads])
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        collectives.all_reduce(stacked, group=group)
    for m, load in zip(layers, stacked):
        bias = local_tensor(m.gate.expert_bias)  # replicated (a DTensor) under tensor parallel: every copy moves
        step = m.args.expert_bias_update_rate * torch.sign(load.mean() - load)
        bias.add_(step.to(device=bias.device, dtype=bias.dtype))
