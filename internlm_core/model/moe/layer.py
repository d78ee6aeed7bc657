"""MoEFeedForward: the mixture-of-experts feed-forward layer, hidden [B, T, h] -> [B, T, h].

    gate (Router)            logits, top-k, capacity, weights, l_aux, l_z (router.py has every formula)
    dispatch                 kept (token, choice) pairs sorted by expert; with expert parallel sent to the rank
                             holding the expert and back (dispatch.py)
    experts (GroupedExperts) w2(silu(w1 x) * w3 x) per expert ("loop" or "grouped" GEMMs, experts.py)
    combine                  out[t] = sum_kept w * expert(x_t), in fp32
    host syncs               one per forward on a CUDA run: the per-expert row counts (the GEMMs' and the
                             all-to-alls' sizes); routing, sorting, statistics and the aux-loss scale stay on
                             the device (tests/unit/test_moe_host_syncs.py)
    shared_experts           optional dense SwiGLU mixed in by a learned 2-way coefficient (InternEvo's residual MoE)
                             or added (DeepSeek's shared experts: shared_expert_mix "sum")
    aux losses               aux_loss_coeff * l_aux + z_loss_coeff * l_z reach the gradient through the output
                             (aux_loss.py), scaled by set_aux_loss_scale; under context parallel (`context`)
                             those of the whole sequences (sequence.py: one all-reduce per forward)

Parameters (names fixed; the model family maps foreign names onto them):
    gate.weight [E, h]; gate.expert_bias [E] fp32 buffer, persistent, when expert_bias_update_rate > 0;
    experts.w1 [E, ffn, h], experts.w3 [E, ffn, h], experts.w2 [E, h, ffn];
    with num_shared_experts = n > 0: shared_experts.w1.weight / w3.weight [n ffn, h], shared_experts.w2.weight
    [h, n ffn] and coefficient.weight [2, h], coefficient.bias [2]:
    out = moe(x) * c0 + shared(x) * c1, (c0, c1) = softmax(coefficient(x)) (InternEvo's moe_use_residual: its
    residual_mlp has the experts' width, so moe_use_residual=True is num_shared_experts=1); with
    shared_expert_mix "sum" there is no coefficient and out = moe(x) + shared(x) (DeepSeek-V2/V3).

Randomness (Jitter, RSample, random token selection) comes from the default generator of the input's device, the
one the trainer seeds and activation checkpointing saves and restores, so a recomputed forward drops the same tokens.
Given the seed, a rank's draws depend only on its own forwards (the sizes drawn are its own token counts, whatever
the expert-parallel layout), so the drop decisions of EP 1 and EP 2 runs with the same per-rank batches agree.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ...errors import ConfigError
from ..layers import Linear
from .args import MoEArgs
from .aux_loss import attach_aux_loss
from .dispatch import combine, exchange_counts, run_expert_parallel, sort_pairs
from .experts import GroupedExperts, SharedExperts
from .router import Router, Routing, route
from .sequence import sequence_sum
from .stats import MoEStats, StatsAccumulator, stats_of
from ..probe import probing


def _in_backward() -> bool:
    """Whether this forward runs inside a backward pass: an activation-checkpoint recompute, whose forward was
    already counted."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


class MoEFeedForward(nn.Module):
    """hidden [B, T, h] -> [B, T, h] (any leading shape): top-k routed SwiGLU experts (see the module docstring).

    `last_stats` (MoEStats) describes the latest forward; `pop_step_stats()` the forwards since its last call (a
    step's micro-batches). After `set_expert_parallel` this rank holds and computes experts
    [ep_rank E/ep, (ep_rank+1) E/ep) only.
    """

    def __init__(self, hidden_size: int, args: MoEArgs, init_std: float = 0.02):
        super().__init__()
        self.args, self.hidden_size = args, hidden_size
        self.gate = Router(hidden_size, args, init_std)
        self.experts = GroupedExperts(args.num_experts, hidden_size, args.ffn_width, args.expert_gemm, init_std)
        self.shared_experts: Optional[SharedExperts] = None
        self.coefficient: Optional[Linear] = None
        if args.num_shared_experts > 0:
            self.shared_experts = SharedExperts(hidden_size, args.num_shared_experts * args.ffn_width, init_std)
            if args.shared_expert_mix == "coefficient":
                self.coefficient = Linear(hidden_size, 2, bias=True)
        self.ep_group, self.ep_size, self.ep_rank = None, 1, 0
        # context parallel (model/context's set_context_parallel sets it): the aux losses are summed over its ranks
        self.context = None
        self.last_stats: Optional[MoEStats] = None
        self._step_stats = StatsAccumulator()
        self._load: Optional[torch.Tensor] = None  # pairs per expert since the last update_expert_bias (training)

    @property
    def num_local_experts(self) -> int:
        return self.args.num_experts // self.ep_size

    def reset_buffers(self) -> None:
        """Zero the expert bias (a model materialized with to_empty holds garbage in its buffers)."""
        if self.gate.expert_bias is not None:
            with torch.no_grad():
                self.gate.expert_bias.zero_()

    def set_expert_parallel(self, group, ep_size: int, ep_rank: int) -> None:
        """From now on this rank holds experts [ep_rank E/ep, (ep_rank+1) E/ep) only and exchanges tokens with the
        `ep_size` ranks of `group` (None: the default group) in forward and backward.

        Expert weights that are plain tensors of all E experts are cut to the local slice here; weights that are
        already local ([E/ep, ...]) or DTensors whose to_local() holds the local experts (Shard(0) over the
        expert-parallel mesh, converted before or after this call) are left as they are.
        """
        E = self.args.num_experts
        if ep_size < 1 or E % ep_size:
            raise ConfigError(f"parallel.expert: {E} experts cannot be split over {ep_size} expert-parallel ranks "
                              f"(expected a divisor of model.num_experts)")
        if not 0 <= ep_rank < ep_size:
            raise ConfigError(f"parallel.expert: rank {ep_rank} outside the expert-parallel group of {ep_size}")
        local = E // ep_size
        for name in ("w1", "w3", "w2"):
            p = getattr(self.experts, name)
            if hasattr(p, "to_local"):
                rows = p.to_local().shape[0]
            elif p.shape[0] == E and local != E:
                setattr(self.experts, name, nn.Parameter(p.detach()[ep_rank * local:(ep_rank + 1) * local].clone(),
                                                         requires_grad=p.requires_grad))
                rows = local
            else:
                rows = p.shape[0]
            if rows != local:
                raise ConfigError(f"parallel.expert: experts.{name} holds {rows} experts on rank {ep_rank}, "
                                  f"expected {local} ({E} experts over {ep_size} ranks)")
        self.ep_group, self.ep_size, self.ep_rank = group, ep_size, ep_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        routing = route(self.gate(flat), self.args, self.training, self.gate.expert_bias,
                        sequence_sum(self.context))
        pairs = sort_pairs(routing, self.args.num_experts)
        # the layer's one host sync: the row counts (with expert parallel the sent and received ones, one copy)
        splits = exchange_counts(pairs.counts, self.ep_group, self.ep_size) if self.ep_size > 1 else None
        local = splits.local if splits is not None else pairs.counts.tolist()
        pairs = pairs.head(sum(splits.send) if splits is not None else sum(local))  # the kept pairs
        rows = flat.index_select(0, pairs.token)
        if splits is not None:
            expert_out = run_expert_parallel(rows, splits, self.experts, self.ep_group, self.ep_size)
        else:
            expert_out = self.experts(rows, local)
        out = combine(expert_out, pairs, flat.shape[0])
        if self.shared_experts is not None:
            out = self._mix_shared(flat, out)
        self._record(routing)
        return self._attach_losses(out, routing).view(*x.shape[:-1], out.shape[-1])

    def _mix_shared(self, flat: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """InternEvo's residual MoE: routed * c0 + shared * c1 with (c0, c1) = softmax(coefficient(x)); without a
        coefficient (shared_expert_mix "sum") routed + shared, in fp32."""
        if self.coefficient is None:
            return (routed.float() + self.shared_experts(flat).float()).to(routed.dtype)
        coef = torch.softmax(self.coefficient(flat).float(), dim=-1)
        dense = self.shared_experts(flat)
        return (routed.float() * coef[:, :1] + dense.float() * coef[:, 1:]).to(routed.dtype)

    def _attach_losses(self, out: torch.Tensor, routing: Routing) -> torch.Tensor:
        """aux_total = aux_loss_coeff * l_aux + z_loss_coeff * l_z into the backward (training with grad only)."""
        if not (self.training and torch.is_grad_enabled()):
            return out
        terms = [c * loss for c, loss in ((self.args.aux_loss_coeff, routing.l_aux),
                                          (self.args.z_loss_coeff, routing.l_z)) if c > 0]
        if not terms or not terms[0].requires_grad:
            return out
        return attach_aux_loss(out, sum(terms[1:], terms[0]))

    @torch.compiler.disable
    def _record(self, routing: Routing) -> None:
        """last_stats, the step's stats and (training) the loads for the expert bias; not again in a recompute.
        Eager under torch.compile: Python counters would otherwise be guarded on and recompile every step."""
        if _in_backward() or probing():  # a recompute, or torch's pipeline metadata inference (model/probe.py)
            return
        self.last_stats = stats_of(routing)
        self._step_stats.add(self.last_stats, self.args.top_k)
        if self.training and self.gate.expert_bias is not None:
            counts = self.last_stats.tokens_per_expert.float()
            self._load = counts if self._load is None else self._load + counts

    def pop_step_stats(self) -> Optional[MoEStats]:
        """The forwards since the last call, summed (tokens per expert, dropped pairs) or averaged (losses)."""
        return self._step_stats.pop()

    def take_load(self) -> Optional[torch.Tensor]:
        """The pairs routed to each expert in training since the last call ([E] fp32, None if none), reset."""
        load, self._load = self._load, None
        return load
