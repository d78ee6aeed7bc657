"""The MoE families' part of the step loop (model.TrainingHooks): the auxiliary losses' gradient scale, the
aux-loss-free expert-bias update, and the load-balance metrics of each step.

Metrics per MoE layer i (over the step's micro-batches, summed over the data-parallel ranks that hold the layer:
the global batch's routing, the same under every layout):
    moe/layer{i}/max_load, min_load   tokens of the busiest / idlest expert over the mean (1.0: balanced)
    moe/layer{i}/dropped              fraction of routed (token, expert) pairs over capacity (0 when dropless)
    moe/layer{i}/aux_loss, z_loss     the load-balancing and router z-losses (before their coefficients)
and over all layers: moe/max_load (the worst layer), moe/dropped and moe/aux_loss (means); under expert parallel
comm/all_to_all_bytes and comm/all_to_alls: what this rank's token all-to-alls sent to other ranks in the step.
Under pipeline parallel every stage reports the layers of all stages (and the all-to-alls of its pipeline's ranks).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ...utils import collectives

from ..moe import MoEFeedForward, pop_all_to_all_bytes, set_aux_loss_scale, update_expert_bias
from ..spec import TrainingHooks


def moe_named_layers(model: nn.Module) -> list[tuple[str, MoEFeedForward]]:
    """(global block index, layer) of every MoE layer this rank holds, in block order; model.mtp's depths after the
    blocks, as "mtp0", "mtp1", ... (metrics moe/layermtp0/...)."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, MoEFeedForward):
            parts = name.split(".")
            index = parts[parts.index("layers") + 1] if "layers" in parts else \
                f"mtp{parts[parts.index('depths') + 1]}" if "depths" in parts else name  # model.mtp's depth k: mtp{k}
            out.append((index, module))
    return sorted(out, key=lambda item: _layer_order(item[0]))


def _layer_order(index: str) -> tuple:
    """Blocks by number, then model.mtp's depths by name."""
    return (0, int(index), "") if index.isdigit() else (1, 0, index)


def _step_table(layers: list[tuple[str, MoEFeedForward]], group: Optional[dist.ProcessGroup]) -> Optional[torch.Tensor]:
    """[layers, E + 5] float64: per layer the pairs routed to each expert, dropped pairs, pairs, aux loss, z loss and
    forwards of the step, summed over `group` (one all-reduce for every layer); None when no layer ran anywhere."""
    if not layers:
        return None
    device = layers[0][1].gate.weight.device  # the group's device (NCCL takes no CPU tensors)
    rows = []
    for _, layer in layers:
        s = layer.pop_step_stats()
        E = layer.args.num_experts
        if s is None:
            rows.append(torch.zeros(E + 5, dtype=torch.float64, device=device))
            continue
        pairs = s.num_tokens * layer.args.top_k
        scalars = [s.dropped_fraction.double() * pairs, torch.full((), pairs, dtype=torch.float64, device=device),
                   s.aux_loss.double(), s.z_loss.double(), torch.ones((), dtype=torch.float64, device=device)]
        # on the device, no value read on the host per layer: the whole table reaches it with one copy
        rows.append(torch.cat([s.tokens_per_expert.to(device=device, dtype=torch.float64),
                               torch.stack([v.to(device) for v in scalars])]))
    table = torch.stack(rows)
    if group is not None and dist.get_world_size(group) > 1:
        collectives.all_reduce(table, group=group)
    return table.cpu()


def _layer_records(layers: list[tuple[str, MoEFeedForward]], table: Optional[torch.Tensor]) -> dict[str, dict]:
    """{layer index: its metrics} of the layers that ran this step, from `_step_table`'s rows."""
    records = {}
    for (index, layer), row in zip(layers, table if table is not None else []):
        E = layer.args.num_experts
        forwards = float(row[E + 4])
        if forwards == 0:
            continue
        load = row[:E]
        mean = float(load.mean()) or 1.0
        records[index] = {"max_load": float(load.max()) / mean, "min_load": float(load.min()) / mean,
                          "dropped": float(row[E]) / max(float(row[E + 1]), 1.0),
                          "aux_loss": float(row[E + 2]) / forwards, "z_loss": float(row[E + 3]) / forwards}
    return records


def _merge_stages(records: dict[str, dict], sent: dict, pp_group: Optional[dist.ProcessGroup]) -> tuple[dict, dict]:
    """Every pipeline stage's layer records (each stage holds other layers) and all-to-all counts (summed)."""
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        return records, sent
    stages: list = [None] * dist.get_world_size(pp_group)
    collectives.all_gather_object(stages, (records, sent), group=pp_group)
    merged = {index: r for stage_records, _ in stages for index, r in stage_records.items()}
    ordered = dict(sorted(merged.items(), key=lambda kv: _layer_order(kv[0])))
    return ordered, {k: sum(stage_sent[k] for _, stage_sent in stages) for k in sent}


def moe_step_metrics(model: nn.Module, group: Optional[dist.ProcessGroup] = None,
                     pp_group: Optional[dist.ProcessGroup] = None) -> dict[str, float]:
    """The step's load-balance metrics (module docstring); empty when no MoE layer ran this step. `group`: the
    data-parallel ranks whose routing is summed (every rank of it must call; None: this rank's alone); `pp_group`:
    the pipeline stages, whose layers' metrics every stage gets (None: this stage's layers only)."""
    layers = moe_named_layers(model)
    records, sent = _merge_stages(_layer_records(layers, _step_table(layers, group)), pop_all_to_all_bytes(),
                                  pp_group)
    out: dict[str, float] = {}
    for index, record in records.items():
        out.update({f"moe/layer{index}/{k}": v for k, v in record.items()})
    if sent["calls"]:  # expert parallel: the token all-to-alls of the step (to other ranks), forward and backward
        out["comm/all_to_all_bytes"], out["comm/all_to_alls"] = sent["bytes"], sent["calls"]
    per_layer = list(records.values())
    if per_layer:
        out["moe/max_load"] = max(r["max_load"] for r in per_layer)
        out["moe/dropped"] = sum(r["dropped"] for r in per_layer) / len(per_layer)
        out["moe/aux_loss"] = sum(r["aux_loss"] for r in per_layer) / len(per_layer)
    return out


MOE_HOOKS = TrainingHooks(before_backward=lambda model, scale: set_aux_loss_scale(scale),
                          after_step=update_expert_bias, step_metrics=moe_step_metrics)
