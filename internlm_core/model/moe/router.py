"""The router: gate logits, top-k selection, capacity, the combine weights and the auxiliary losses.

`Router` is the module (`gate.weight` [E, h], `gate.expert_bias` [E] when bias balancing is on); `route` is a pure
function of the logits (plus the device's default generator for RSample / random token selection), so the gating
of a hand-computed case can be checked without a layer.

The formulas, following InternEvo's `internlm/model/moe/gshard_layer.py` (DeepSpeed's sharded_moe) and
`dropless_layer.py`:

- logits = x W^T in fp32 (autocast off), scores = softmax(logits) (or sigmoid(logits)).
- selection: top-k of the scores (+ expert_bias when bias balancing is on: selection only, never the weights).
  Group-limited (DeepSeek-V3, num_expert_groups G > top_k_groups g): the E experts form G equal groups, a group's
  score is the sum of its 2 best selection scores, and a token's top-k is taken over its g best groups only
  (transformers' DeepseekV3TopkRouter).
  RSample (training): Gumbel(0, 1) noise on the logits chooses the expert when k == 1 (InternEvo top1gating) and
  choices 2..k after the clean first choice when k >= 2 (InternEvo top2gating samples its second expert so,
  always; here only under RSample).
- capacity (GShard/MegaBlock, drop_tokens): C = max(ceil(S / E * factor * k), min_capacity). An expert keeps its
  first C (token, choice) pairs in the order: every token's first choice, then every token's second choice, ...
  (tokens in position order within a choice: InternEvo's locations cumsum over the k-major masks); with use_rts and
  k == 1 the kept pairs are a uniformly random subset instead (InternEvo top1gating: topk over mask * U(0, 1)).
- weights: the scores of the chosen experts, 0 for a dropped pair; norm_topk_prob divides by the sum of the kept
  ones (clamped to fp32 eps, InternEvo's denom_s); without it the raw scores (InternEvo's classic top-1); then
  times routed_scaling_factor (DeepSeek-V3's 2.5; 1 elsewhere).
- l_aux = E * sum_e P_e * f_e, P_e = mean over tokens of the (softmax / normalized sigmoid) scores;
  capacity-bounded: f_e = fraction of tokens whose FIRST choice is e, before dropping (InternEvo GShard top1, top2
  and fused top-k: `ce` from mask1 / masks[0]); Dropless: f_e = (all k choices routed to e) / (S k) (InternEvo
  dropless `load_balancing_loss`). For k == 1 both agree.
- l_z = mean over tokens of logsumexp(logits)^2 (ST-MoE router z-loss).
- under context parallel (`over`: sequence.py's SequenceSum) the sums behind P_e, f_e, l_z and the token count
  are summed over the ranks holding the other chunks of the sequences first: l_aux and l_z are the whole
  sequences'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .args import MoEArgs

JITTER_EPS = 1e-2  # InternEvo/DeepSpeed multiplicative_jitter's epsilon


@dataclass
class Routing:
    """One forward's routing of S tokens: experts [S, k] (global ids), weights [S, k] fp32 (0 where dropped),
    keep [S, k] bool or None (None: nothing dropped), tokens_per_expert [E] (every choice, before dropping),
    the losses (scalars with their graph) and the capacity (None when unbounded)."""

    experts: torch.Tensor
    weights: torch.Tensor
    keep: Optional[torch.Tensor]
    tokens_per_expert: torch.Tensor
    l_aux: torch.Tensor
    l_z: torch.Tensor
    capacity: Optional[int]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (its to_local(), through which the gradient flows back), a plain tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


class Router(nn.Module):
    """The gate: `weight` [E, h] (fp32 logits whatever the compute dtype, as InternEvo's "always fp32" gate) and,
    with aux-loss-free balancing, the persistent `expert_bias` [E] buffer (checkpointed, no gradient).
    `fsdp_param_dtype`: under FSDP's 16-bit policy the gate is a unit of its own gathered in fp32
    (parallel/dtype_policy.py), so its logits are those of the fp32 weight, as on one device."""

    fsdp_param_dtype = torch.float32

    def __init__(self, hidden_size: int, args: MoEArgs, init_std: float = 0.02):
        super().__init__()
        self.noisy_gate_policy = args.noisy_gate_policy
        self.weight = nn.Parameter(torch.empty(args.num_experts, hidden_size))
        nn.init.normal_(self.weight, std=init_std)
        keep = args.expert_bias_update_rate > 0 or args.expert_bias
        bias = torch.zeros(args.num_experts, dtype=torch.float32) if keep else None
        self.register_buffer("expert_bias", bias, persistent=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [S, h] -> logits [S, E] in fp32; Jitter (training) scales the router's input only."""
        if self.noisy_gate_policy == "Jitter" and self.training:
            noise = torch.empty_like(x).uniform_(1.0 - JITTER_EPS, 1.0 + JITTER_EPS)
            x = x * noise
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), local_tensor(self.weight).float())


def expert_counts(ids: torch.Tensor, num_experts: int, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int64 [num_experts]: how often each expert id occurs in `ids` (where `weight`, bool like ids, is True);
    torch.bincount's counts without its host sync (on CUDA it reads the largest id to size its output)."""
    ones = torch.ones_like(ids) if weight is None else weight.to(ids.dtype)
    return torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, ids.reshape(-1),
                                                                                        ones.reshape(-1))


def gumbel_like(t: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) samples shaped like t, from the device's default generator: -log(Exp(1))."""
    return torch.empty_like(t).exponential_().log_().neg_()


def limit_to_groups(key: torch.Tensor, groups: int, chosen: int) -> torch.Tensor:
    """`key` [S, E] with -inf outside each token's `chosen` best of `groups` equal expert groups, a group scored
    by the sum of its 2 best keys (DeepSeek-V3's group-limited routing)."""
    S, E = key.shape
    grouped = key.view(S, groups, E // groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    best = group_scores.topk(chosen, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(S, E)


def select_experts(scores: torch.Tensor, logits: torch.Tensor, bias: Optional[torch.Tensor], k: int,
                   rsample: bool, groups: tuple[int, int] = (1, 1)) -> torch.Tensor:
    """The k experts of each token [S, k] (first choice first): top-k of scores (+ bias), within the best
    groups[1] of groups[0] expert groups when groups[1] < groups[0]; with `rsample` the Gumbel-max draws
    described in the module docstring."""
    with torch.no_grad():
        # a DTensor under tensor parallel (the gate's buffers replicated with its weight): its local copy
        key = scores if bias is None else scores + local_tensor(bias).to(scores.dtype)
        if groups[1] < groups[0]:
            key = limit_to_groups(key, *groups)
        if not rsample:
            return torch.topk(key, k, dim=-1).indices
        noisy = logits + gumbel_like(logits)
        if k == 1:
            return noisy.argmax(dim=-1, keepdim=True)
        first = key.argmax(dim=-1, keepdim=True)
        rest = torch.topk(noisy.scatter(-1, first, float("-inf")), k - 1, dim=-1).indices
        return torch.cat([first, rest], dim=-1)


def capacity_keep(experts: torch.Tensor, num_experts: int, capacity: int, random_order: bool) -> torch.Tensor:
    """keep [S, k]: whether each (token, choice) pair is among its expert's first `capacity` pairs, counted
    choice-major (all first choices before any second choice), tokens in position order or, with `random_order`,
    in a random order drawn from the device's default generator (random token selection)."""
    S, k = experts.shape
    with torch.no_grad():
        flat = experts.t().reshape(-1)  # choice-major
        priority = torch.arange(S * k, device=flat.device)
        if random_order:  # within one choice: a random permutation of the tokens
            perm = torch.argsort(torch.rand(S, device=flat.device), dim=0)
            priority = (torch.arange(k, device=flat.device)[:, None] * S + perm[None, :]).reshape(-1)
        by_priority = flat[priority]
        order = torch.argsort(by_priority, stable=True)  # grouped by expert, priority order inside each group
        counts = expert_counts(flat, num_experts)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(S * k, device=flat.device) - starts[by_priority[order]]
        position = torch.empty_like(rank)
        position[priority[order]] = rank
        return (position < capacity).view(k, S).t()


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, tokens_per_expert: torch.Tensor,
                        capacity_bounded: bool) -> torch.Tensor:
    """l_aux = E * sum_e P_e f_e (see the module docstring for f_e in the two modes)."""
    S, E = probs.shape
    if capacity_bounded:
        f = expert_counts(experts[:, 0], E).to(probs.dtype) / S
    else:
        f = tokens_per_expert.to(probs.dtype) / (S * experts.shape[1])
    return E * torch.sum(probs.mean(dim=0) * f)


def aux_losses_over(probs: torch.Tensor, logits: torch.Tensor, experts: torch.Tensor,
                    tokens_per_expert: torch.Tensor, capacity_bounded: bool,
                    over: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(l_aux, l_z) of the whole sequences whose chunks the ranks of `over` hold: one sum of [probabilities per
    expert, counts per expert, z-loss sum, tokens] over them, then the module docstring's formulas."""
    S, E = probs.shape
    counts = expert_counts(experts[:, 0], E) if capacity_bounded else tokens_per_expert
    z = torch.logsumexp(logits, dim=-1).square().sum()
    sums = over(torch.cat([probs.sum(dim=0), counts.to(probs.dtype), z.view(1), probs.new_full((1,), float(S))]))
    tokens = sums[-1]
    f = sums[E:2 * E] / (tokens if capacity_bounded else tokens * experts.shape[1])
    return E * torch.sum(sums[:E] / tokens * f), sums[2 * E] / tokens


def route(logits: torch.Tensor, args: MoEArgs, training: bool, bias: Optional[torch.Tensor] = None,
          over: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> Routing:
    """The routing of S tokens from their fp32 logits [S, E] (see the module docstring for every formula); `over`:
    the sum over the context ranks (context parallel: the aux losses of the whole sequences), None: these tokens'."""
    S, E = logits.shape
    k = args.top_k
    scores = torch.softmax(logits, dim=-1) if args.score_func == "softmax" else torch.sigmoid(logits)
    rsample = args.noisy_gate_policy == "RSample" and training
    experts = select_experts(scores, logits, bias, k, rsample, (args.num_expert_groups, args.top_k_groups))
    tokens_per_expert = expert_counts(experts, E)
    weights = scores.gather(1, experts)
    keep, capacity = None, None
    if args.capacity_bounded and args.drop_tokens:  # drop_tokens=False: unbounded (nothing is padded here)
        capacity = args.capacity(S, training)
        keep = capacity_keep(experts, E, capacity, random_order=args.use_rts and k == 1)
        weights = weights * keep
    if args.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).eps)
    if args.routed_scaling_factor != 1.0:
        weights = weights * args.routed_scaling_factor
    probs = scores if args.score_func == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    if over is not None:
        l_aux, l_z = aux_losses_over(probs, logits, experts, tokens_per_expert, args.capacity_bounded, over)
    else:
        l_aux = load_balancing_loss(probs, experts, tokens_per_expert, args.capacity_bounded)
        l_z = torch.logsumexp(logits, dim=-1).square().mean()
    return Routing(experts, weights, keep, tokens_per_expert, l_aux, l_z, capacity)
