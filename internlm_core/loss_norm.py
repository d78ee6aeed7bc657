"""The loss contract, in one place: which loss each rank backpropagates so that the gradient the optimizer sees is
that of one number, the step's loss L over the whole global batch. Every path uses `LossNormalizer`: the plain loop,
every pipeline schedule, context parallel, the families' auxiliary losses, FSDP's division of the gradients and the
reported loss. `loss.reduction` picks one of two contracts.

The global batch. A step's global batch is M = dp * micro_num micro-batches (each of the dp data-parallel ranks
reads micro_num of them; the cp context ranks of a group read the same ones and each holds a chunk of every row).
Micro-batch m has N_m counted tokens (label != -100) with per-token loss l_t (cross entropy; with the fused head's
z-loss, plus z * logsumexp^2), and N = sum_m N_m counts the whole global batch.

token_mean (the default): every counted token of the global batch weighs the same, whatever the packing,

    L = (1 / N) * sum_t l_t                                     (+ the families' auxiliary losses, below)

micro_batch_mean (InternLM's and InternEvo's loss, for a run continued from theirs whose curves are compared): each
micro-batch weighs the same, with mu_m = (1 / N_m) * sum_{t in m} l_t its token mean (0 when N_m = 0),

    L = (1 / M) * sum_m mu_m

The two are equal when every micro-batch counts N / M tokens. Every layout computes the same L and its gradient
(one process with micro_num = M is the reference the parallel tests compare with).

Written over the ranks. Both are L = (1 / Z) * sum_{data rank r, context rank c} sum_{i < micro_num} c_ic, with
c_ic the term of micro-batch i's chunk on rank (r, c) (`part`, from the loss function's chunk mean mu_ic over its
n_ic counted tokens):

    token_mean:        c_ic = mu_ic * n_ic  (the chunk's loss sum, n_ic counted on the device)   Z = N
    micro_batch_mean:  c_ic = s_ic * mu_ic  (s_ic = n_ic / N_i: `context_share`, 1 without CP)    Z = M

- data parallel: rank r holds micro_num of the M micro-batches; gradient accumulation: one backward per micro-batch.
- context parallel: the chunks of one micro-batch sum to its term (sum_c n_ic mu_ic = N_i mu_i; sum_c s_ic mu_ic =
  mu_i). Under token_mean no share is needed: each chunk contributes its loss sum / N.
- pipeline parallel: the micro-batches are the same; only the last stage computes the loss, once per micro-batch,
  in whatever order its schedule (1F1B, interleaved, zero-bubble) runs them. The term travels with the micro-batch:
  its chunk count comes from the labels the loss call receives, and its share (micro_batch_mean) is looked up by
  the micro-batch's index, which its target carries (parallel/pipeline.py); no loss call is counted.
- tensor parallel: every tensor-parallel rank computes the same loss (gradients of replicated parameters are not
  summed over it).

N (token_mean) is counted from the labels of all the step's micro-batches before the first backward: each rank
counts its rows on the host (the cp ranks of a group hold the same rows) and one all-reduce over the "dp" ranks sums
them on the device (`global_token_count`): a 0-dim device tensor that is never read on the host. A step with N = 0
(every label -100) backpropagates zeros: every c_ic is 0 and the factors divide by max(N, 1).

The factors. FSDP reduces every gradient over the D = dp * cp data and context ranks (its mesh dp_replicate x
dp_shard x cp) and divides by D (`grad_divisor`). For the result to be S * dL/dw (S: the gradient scaler's loss
scale, which the optimizer step divides out), rank (r, c) backpropagates, one backward per micro-batch,

    c_ic * S * D / Z      token_mean: S * D / N (a 0-dim device tensor); micro_batch_mean: S * cp / micro_num
                          (`backward_factor`; the pipeline's schedule must not divide again: scale_grads=False)

Auxiliary losses (MoE load balance and router z-loss), the same under both reductions: a family's layers add
theirs inside the model, with d(backpropagated)/d(aux) = S / micro_num on every rank (`aux_factor`, handed to
`TrainingHooks.before_backward`). After FSDP's mean over the D ranks they enter L as (1 / (M * cp)) times the sum,
over the global batch's micro-batches and context chunks, of each chunk's aux (itself a mean over the chunk's
tokens): their mean over the global batch's chunks, each chunk weighing the same (InternEvo's meaning). The fused
head's z-loss is no auxiliary loss: it is part of each token's l_t and follows the reduction.

Modules sharded over a family's own dimension (expert parallel): the forward combines the dimension's tokens, so
their gradient already sums its ranks' contributions and FSDP sums the remaining data ranks and the context ranks
(their mesh: dp_shard_rest x cp, with the replicas); they are divided by the same D = dp * cp, not by the ranks of
their own mesh (`grad_divisor`). Under context parallel a family's aux losses are the whole sequences' on every
context rank (model/moe/sequence.py: the router statistics summed over the cp ranks, their gradient cp times each
rank's own), so they enter L as the mean over the global batch's micro-batches, as without context parallel.

Fault tolerance (parallel.fault_tolerance): each replica group computes its own L over its own global batch (N of
its own ranks); the groups' gradients are averaged, each group weighing the same (a group may drop out of a step).

The reported loss: each rank sums its c_ic (`rank_loss` divides the sum by Z / dp); summed over the "pp_dp" ranks
(the last pipeline stage holds it, the others 0; the context ranks hold parts of it) and divided by dp
(`global_loss`), it is L. ACC and PPL are the metric's (metrics.py), counted over tokens under both reductions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Union

import torch
import torch.distributed as dist

from .utils import collectives
from .utils.transfer import to_device

Share = Union[float, torch.Tensor]  # a float, or a 0-dim tensor on the device (no host read)
REDUCTIONS = ("token_mean", "micro_batch_mean")  # loss.reduction
IGNORE = -100  # the label of a token without loss


class DataDims(Protocol):
    """What the normalizer reads of the parallel layout (distributed.ParallelDims)."""

    @property
    def dp(self) -> int: ...  # noqa: D102

    @property
    def cp(self) -> int: ...  # noqa: D102

    def group(self, name: str) -> Optional[dist.ProcessGroup]: ...  # noqa: D102


def grad_divisor(dp: int, cp: int) -> int:
    """D: the data and context ranks whose gradients FSDP sums and divides by (module docstring)."""
    return dp * cp


def context_share(chunk_labels: torch.Tensor, labels: torch.Tensor) -> float:
    """s_mc (micro_batch_mean): the counted tokens (label != -100) of a context chunk over its micro-batch's; 0.0 for
    a micro-batch without any (its loss is 0 on every rank: the loss's count is clamped to 1)."""
    total = int((labels != IGNORE).sum())
    return int((chunk_labels != IGNORE).sum()) / total if total else 0.0


def count_tokens(labels: torch.Tensor) -> torch.Tensor:
    """The counted tokens (label != -100) of `labels`: a 0-dim int64 tensor where the labels are (no host read)."""
    return (labels != IGNORE).sum()


def global_token_count(labels: torch.Tensor, device: torch.device,
                       group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """N: the counted tokens of `labels` (this rank's rows of the step, on the host), copied to `device` without a
    host wait and summed there over `group` (the data-parallel ranks; None: one): a 0-dim int64 device tensor."""
    n = to_device(count_tokens(labels).reshape(1), device)
    if group is not None:
        collectives.all_reduce(n, group=group)
    return n.view(())


@dataclass(frozen=True)
class LossNormalizer:
    """The factors of one step's losses on this rank (module docstring: the contracts and their derivation).

    micro_num: micro-batches this rank runs in the step; dp: data-parallel ranks (each reads its own micro-batches);
    cp: context-parallel ranks (each holds a chunk of every micro-batch); reduction: one of REDUCTIONS; tokens: N, the
    global batch's counted tokens as a 0-dim device tensor (token_mean only; `of_step` counts it)."""

    micro_num: int
    dp: int = 1
    cp: int = 1
    reduction: str = "token_mean"
    tokens: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        for name in ("micro_num", "dp", "cp"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"LossNormalizer.{name}: expected a positive int, got {getattr(self, name)!r}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"LossNormalizer.reduction: expected one of {', '.join(REDUCTIONS)}, "
                             f"got {self.reduction!r}")

    @classmethod
    def of_step(cls, reduction: str, micro_num: int, dims: DataDims, labels: torch.Tensor,
                device: torch.device) -> "LossNormalizer":
        """The normalizer of one step; token_mean counts N from `labels`, this rank's rows of all its micro-batches
        (on the host, before the first backward), summed over the data-parallel ranks on the device."""
        if reduction != "token_mean":
            return cls(micro_num, dims.dp, dims.cp, reduction)
        group = dims.group("dp") if dims.dp > 1 else None
        return cls(micro_num, dims.dp, dims.cp, reduction, global_token_count(labels, device, group))

    @property
    def grad_divisor(self) -> int:
        """D = dp * cp: what FSDP divides the summed gradients by."""
        return grad_divisor(self.dp, self.cp)

    def _n(self) -> torch.Tensor:
        """max(N, 1): a step without counted tokens has every term 0 (its gradient is 0, not nan)."""
        if self.tokens is None:
            raise ValueError("LossNormalizer: reduction 'token_mean' needs tokens (N, the global batch's counted "
                             "tokens: LossNormalizer.of_step counts them)")
        return self.tokens.clamp(min=1)

    def part(self, loss: torch.Tensor, labels: torch.Tensor, share: Optional[Share] = None) -> torch.Tensor:
        """c: a chunk's term of Z * L from its token mean `loss` over `labels` (the labels the loss was computed
        on): token_mean its loss sum, mean * count (counted on the device); micro_batch_mean its share of its
        micro-batch's mean, s * mean (`loss` itself without context parallel: share None)."""
        if self.reduction == "token_mean":
            return loss * count_tokens(labels)
        return loss if share is None else loss * share

    def backward_factor(self, scale: float = 1.0) -> Share:
        """What each term (`part`) is multiplied by before its backward, S * D / Z, so that FSDP's mean over the D
        ranks leaves S * dL/dw: token_mean a 0-dim fp32 device tensor S * D / N, micro_batch_mean S * cp /
        micro_num."""
        if self.reduction == "token_mean":
            return (scale * self.grad_divisor) / self._n().float()
        return scale * self.cp / self.micro_num

    def aux_factor(self, scale: float = 1.0) -> float:
        """d(backpropagated)/d(aux) for a family's auxiliary losses: S / micro_num (both reductions)."""
        return scale / self.micro_num

    def rank_loss(self, total: torch.Tensor) -> torch.Tensor:
        """This rank's part of the reported loss from the sum of its terms: total * dp / Z (see `global_loss`)."""
        if self.reduction == "token_mean":
            return total * self.dp / self._n()
        return total / self.micro_num

    def global_loss(self, summed: torch.Tensor) -> torch.Tensor:
        """L from the sum of `rank_loss` over the "pp_dp" ranks."""
        return summed / self.dp
