"""The MoE families' part of the step loop (model.TrainingHooks): the auxiliary losses' gradient scale, the
aux-loss-free expert-bias update, and the load-balance metrics of each step.

Metrics per MoE layer i (over the step's micro-batches, as this rank routed them):
    moe/layer{i}/max_load, min_load   tokens of the busiest / idlest expert over the mean (1.0: balanced)
    moe/layer{i}/dropped              fraction of routed (token, expert) pairs over capacity (0 when dropless)
    moe/layer{i}/aux_loss, z_loss     the load-balancing and router z-losses (before their coefficients)
and over all layers: moe/max_load (the worst layer), moe/dropped and moe/aux_loss (means); under expert parallel
comm/all_to_all_bytes and comm/all_to_alls: what this rank's token all-to-alls sent to other ranks in the step.
"""

from __future__ import annotations

import torch.nn as nn

from ..moe import MoEFeedForward, pop_all_to_all_bytes, set_aux_loss_scale, update_expert_bias
from ..spec import TrainingHooks


def moe_named_layers(model: nn.Module) -> list[tuple[str, MoEFeedForward]]:
    """(global block index, layer) of every MoE layer this rank holds, in block order."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, MoEFeedForward):
            parts = name.split(".")
            index = parts[parts.index("layers") + 1] if "layers" in parts else name
            out.append((index, module))
    return sorted(out, key=lambda item: int(item[0]) if item[0].isdigit() else 0)


def moe_step_metrics(model: nn.Module) -> dict[str, float]:
    """The step's load-balance metrics (module docstring); empty when no MoE layer ran this step."""
    out: dict[str, float] = {}
    per_layer = []
    for index, layer in moe_named_layers(model):
        stats = layer.pop_step_stats()
        if stats is None:
            continue
        load = stats.tokens_per_expert.double()
        mean = float(load.mean()) or 1.0
        record = {"max_load": float(load.max()) / mean, "min_load": float(load.min()) / mean,
                  "dropped": float(stats.dropped_fraction), "aux_loss": float(stats.aux_loss),
                  "z_loss": float(stats.z_loss)}
        out.update({f"moe/layer{index}/{k}": v for k, v in record.items()})
        per_layer.append(record)
    sent = pop_all_to_all_bytes()
    if sent["calls"]:  # expert parallel: the token all-to-alls of the step (to other ranks), forward and backward
        out["comm/all_to_all_bytes"], out["comm/all_to_alls"] = sent["bytes"], sent["calls"]
    if per_layer:
        out["moe/max_load"] = max(r["max_load"] for r in per_layer)
        out["moe/dropped"] = sum(r["dropped"] for r in per_layer) / len(per_layer)
        out["moe/aux_loss"] = sum(r["aux_loss"] for r in per_layer) / len(per_layer)
    return out


MOE_HOOKS = TrainingHooks(before_backward=lambda model, scale: set_aux_loss_scale(scale),
                          after_step=update_expert_bias, step_metrics=moe_step_metrics)
