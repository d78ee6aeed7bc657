"""MoEArgs: the plain values one mixture-of-experts feed-forward layer is built from.

The model family fills them from its `model` / `moe` config sections (InternEvo's spellings are mapped there, not
here); the layer never sees a Config. Every choice below says what InternEvo does, so an InternEvo config can be
mapped onto it field by field (see `MoEFeedForward` for the formulas).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...errors import ConfigError

MOE_TYPES = ("GShard", "MegaBlock", "Dropless")
NOISY_GATE_POLICIES = (None, "Jitter", "RSample")
SCORE_FUNCS = ("softmax", "sigmoid")
EXPERT_GEMMS = ("loop", "grouped")
SHARED_MIXES = ("coefficient", "sum")


@dataclass(frozen=True)
class MoEArgs:
    """One MoE layer's settings (shapes, routing, losses, balancing, kernels).

    num_experts: routed experts E. top_k: experts per token k.
    ffn_width: each expert's SwiGLU width (w1/w3: [ffn_width, hidden], w2: [hidden, ffn_width]).
    moe_type: "GShard" and "MegaBlock" are capacity-bounded (tokens over an expert's capacity are dropped: their
        slot contributes 0); "Dropless" (InternEvo's "MegaBlock-D" / "Dropless") sends every token to its k experts.
    capacity_factor / eval_capacity_factor: capacity = max(ceil(tokens / E * factor * k), min_capacity), the
        training / evaluation factor (InternEvo's `_capacity` with `capacity_factor * k`).
    min_capacity: the capacity floor. drop_tokens: False keeps every token (capacity = the largest load).
    use_rts: random token selection: with top_k == 1 the tokens an over-full expert keeps are a uniformly random
        subset instead of the first ones (InternEvo/DeepSpeed top1gating; their top-2/top-k gating has none).
    noisy_gate_policy: None; "Jitter": the router's input times U(1-1e-2, 1+1e-2) in training; "RSample": Gumbel
        noise on the logits for the selection in training (the first choice when k == 1, choices 2..k otherwise).
    score_func: "softmax" or "sigmoid" router scores. norm_topk_prob: the kept top-k weights of a token are
        renormalized to sum 1 (InternEvo's top-2/top-k gating and dropless layers do; its classic top-1 gating
        does not: map top_k == 1 GShard to False).
    aux_loss_coeff: the load-balancing loss' coefficient (InternEvo's loss.moe_loss_coeff).
    z_loss_coeff: the router z-loss' coefficient (ST-MoE), 0 = off.
    expert_bias_update_rate: > 0 enables aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the
        scores for the selection only, moved by `update_expert_bias` after each step: bias += rate * sign(mean - load).
    num_shared_experts: > 0 adds a dense SwiGLU of width num_shared_experts * ffn_width beside the experts, mixed
        by a learned 2-way softmax coefficient (InternEvo's moe_use_residual is num_shared_experts=1) or summed.
    shared_expert_mix: how the shared experts join the routed output: "coefficient" (InternEvo's residual MoE:
        routed * c0 + shared * c1, (c0, c1) = softmax(coefficient(x))) or "sum" (DeepSeek: routed + shared).
    num_expert_groups / top_k_groups: group-limited routing (DeepSeek-V3's n_group / topk_group): the experts form
        num_expert_groups equal groups, a group scores the sum of its 2 best selection scores, and each token
        chooses its top_k experts among its top_k_groups best groups only. 1 / 1: no limit.
    routed_scaling_factor: the routed experts' combine weights times this, after norm_topk_prob (DeepSeek-V3 2.5).
    expert_bias: keep `gate.expert_bias` (selection only, checkpointed) even with expert_bias_update_rate 0, so
        that a loaded bias (DeepSeek's e_score_correction_bias) routes as trained, frozen.
    expert_gemm: "loop" (one GEMM per expert) or "grouped" (torch's grouped GEMM where it exists for the device and
        dtype; the loop otherwise).
    """

    num_experts: int
    top_k: int = 2
    ffn_width: int = 0
    moe_type: str = "GShard"
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    drop_tokens: bool = True
    use_rts: bool = True
    noisy_gate_policy: str | None = None
    score_func: str = "softmax"
    norm_topk_prob: bool = True
    aux_loss_coeff: float = 0.01
    z_loss_coeff: float = 0.0
    expert_bias_update_rate: float = 0.0
    num_shared_experts: int = 0
    expert_gemm: str = "loop"
    shared_expert_mix: str = "coefficient"
    num_expert_groups: int = 1
    top_k_groups: int = 1
    routed_scaling_factor: float = 1.0
    expert_bias: bool = False

    def __post_init__(self) -> None:
        policy = None if self.noisy_gate_policy in (None, "None") else self.noisy_gate_policy
        object.__setattr__(self, "noisy_gate_policy", policy)
        _check(self.num_experts >= 1, "num_experts", "an int >= 1", self.num_experts)
        _check(1 <= self.top_k <= self.num_experts, "top_k", f"an int in [1, num_experts={self.num_experts}]",
               self.top_k)
        _check(self.ffn_width >= 1, "ffn_width", "an int >= 1", self.ffn_width)
        _check(self.moe_type in MOE_TYPES, "moe_type", f"one of {MOE_TYPES}", self.moe_type)
        _check(self.noisy_gate_policy in NOISY_GATE_POLICIES, "noisy_gate_policy", "None, 'Jitter' or 'RSample'",
               self.noisy_gate_policy)
        _check(self.score_func in SCORE_FUNCS, "score_func", f"one of {SCORE_FUNCS}", self.score_func)
        _check(self.expert_gemm in EXPERT_GEMMS, "expert_gemm", f"one of {EXPERT_GEMMS}", self.expert_gemm)
        for key in ("capacity_factor", "eval_capacity_factor"):
            _check(getattr(self, key) > 0, key, "a number > 0", getattr(self, key))
        for key in ("min_capacity", "aux_loss_coeff", "z_loss_coeff", "expert_bias_update_rate", "num_shared_experts"):
            _check(getattr(self, key) >= 0, key, "a number >= 0", getattr(self, key))
        _check(self.shared_expert_mix in SHARED_MIXES, "shared_expert_mix", f"one of {SHARED_MIXES}",
               self.shared_expert_mix)
        self._check_groups()
        _check(self.routed_scaling_factor > 0, "routed_scaling_factor", "a number > 0", self.routed_scaling_factor)
        _check(not (self.expert_bias_update_rate > 0 and self.noisy_gate_policy == "RSample"), "noisy_gate_policy",
               "not 'RSample' together with expert_bias_update_rate > 0 (the bias is in score units, the Gumbel "
               "noise in logit units)", self.noisy_gate_policy)

    def _check_groups(self) -> None:
        groups, chosen = self.num_expert_groups, self.top_k_groups
        _check(groups >= 1 and self.num_experts % groups == 0, "num_expert_groups",
               f"an int >= 1 dividing num_experts={self.num_experts}", groups)
        _check(groups == 1 or self.num_experts // groups >= 2, "num_expert_groups",
               "groups of 2 or more experts (a group scores its 2 best)", groups)
        _check(1 <= chosen <= groups, "top_k_groups", f"an int in [1, num_expert_groups={groups}]", chosen)
        _check(not (chosen < groups and self.noisy_gate_policy == "RSample"), "noisy_gate_policy",
               "not 'RSample' with group-limited routing (top_k_groups < num_expert_groups: the Gumbel draw would "
               "ignore the groups)", self.noisy_gate_policy)
        _check(chosen * (self.num_experts // groups) >= self.top_k, "top_k_groups",
               f"groups holding at least top_k={self.top_k} experts", chosen)

    @property
    def group_limited(self) -> bool:
        """Whether the selection is limited to each token's top_k_groups best expert groups."""
        return self.top_k_groups < self.num_expert_groups

    @property
    def capacity_bounded(self) -> bool:
        """Whether tokens beyond an expert's capacity are dropped (GShard, MegaBlock) or not (Dropless)."""
        return self.moe_type != "Dropless"

    def capacity(self, num_tokens: int, training: bool) -> int:
        """InternEvo's capacity for `num_tokens` routed tokens: ceil(tokens / E * factor * k), at least
        min_capacity (the factor is eval_capacity_factor outside training)."""
        factor = self.capacity_factor if training else self.eval_capacity_factor
        return max(math.ceil(num_tokens / self.num_experts * factor * self.top_k), self.min_capacity)


def _check(ok: bool, key: str, expected: str, got: object) -> None:
    if not ok:
        raise ConfigError(f"moe.{key}: expected {expected}, got {got!r}")
