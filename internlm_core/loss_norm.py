"""The loss contract, in one place: which loss each rank backpropagates so that the gradient the optimizer sees is
that of one number, the step's loss over the whole global batch. Every path uses `LossNormalizer`: the plain loop,
every pipeline schedule, context parallel (`context_share`), the families' auxiliary losses and FSDP's division of
the gradients of modules sharded over a family's own dimension.

The contract. A step's global batch is M = dp * micro_num micro-batches (each of the dp data-parallel ranks reads
micro_num of them). Micro-batch m has N_m counted tokens (label != -100) with per-token cross entropy l_t, and its
token mean mu_m = (1 / N_m) * sum_{t in m} l_t (0 when N_m = 0). The step's loss is

    L = (1 / M) * sum_m mu_m        (+ the families' auxiliary losses, below)

the mean over the global batch's micro-batches of each one's token mean (InternLM's and InternEvo's loss). It is
the global token mean sum_t l_t / sum_m N_m exactly when the micro-batches count equal tokens; otherwise each
micro-batch weighs the same, not each token. Every layout computes this same L and its gradient (one process with
micro_num = M is the reference the parallel tests compare with):

- data parallel: rank r holds micro_num of the M micro-batches; gradient accumulation: one backward per micro-batch.
- context parallel: the cp ranks of a group hold chunks of the same micro-batch; chunk c counts N_mc tokens and the
  loss function returns its mean mu_mc. With the share s_mc = N_mc / N_m (`context_share`), sum_c s_mc mu_mc = mu_m.
  Without context parallel s = 1.
- pipeline parallel: the micro-batches are the same; only the last stage computes the loss, once per micro-batch,
  and the micro-batch's index travels with its target through the schedule, which picks its share.
- tensor parallel: every tensor-parallel rank computes the same loss (gradients of replicated parameters are not
  summed over it).

Derivation. Written over the ranks, L = sum_{data rank r, context rank c} sum_{i < micro_num} (s_ic / M) * mu_ic.
FSDP reduces every gradient over the D = dp * cp data and context ranks (its mesh dp_replicate x dp_shard x cp)
and divides by D (`grad_divisor`). For the result to be S * dL/dw (S: the gradient scaler's loss scale, which the
optimizer step divides out), rank (r, c) backpropagates

    sum_i (s_ic * mu_ic) * S * D / M  =  sum_i (s_ic * mu_ic) * S * cp / micro_num        (`backward_factor`)

one backward per micro-batch (the pipeline's schedule runs them; it must not divide again: scale_grads=False).

Auxiliary losses (MoE load balance, z-loss): a family's layers add theirs inside the model, with
d(backpropagated)/d(aux) = S / micro_num on every rank (`aux_factor`, handed to `TrainingHooks.before_backward`).
After FSDP's mean over the D ranks they enter L as (1 / (M * cp)) * sum over the micro-batches and context chunks of
each rank's aux (itself a mean over the rank's tokens): their mean over the global batch's chunks.

Modules sharded over a family's own dimension (expert parallel): the forward combines the dimension's tokens, so
their gradient already sums its ranks' contributions and FSDP sums the remaining data ranks; they are divided by
the same D, not by the ranks of their own mesh (`grad_divisor`; the config refuses context parallel with such a
dimension, so D = dp there).

The reported loss: each rank sums s_i * mu_i over its micro-batches and divides by micro_num (`rank_loss`); summed
over the "pp_dp" ranks (the last pipeline stage holds it, the others 0; the context ranks hold parts of one mean)
and divided by dp (`global_loss`), it is L.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

Share = Union[float, torch.Tensor]  # a float, or a 0-dim tensor on the device (no host read)


def grad_divisor(dp: int, cp: int) -> int:
    """D: the data and context ranks whose gradients FSDP sums and divides by (module docstring)."""
    return dp * cp


def context_share(chunk_labels: torch.Tensor, labels: torch.Tensor) -> float:
    """s_mc: the counted tokens (label != -100) of a context chunk over its micro-batch's; 0.0 for a micro-batch
    without any (its loss is 0 on every rank: the loss's count is clamped to 1)."""
    total = int((labels != -100).sum())
    return int((chunk_labels != -100).sum()) / total if total else 0.0


@dataclass(frozen=True)
class LossNormalizer:
    """The factors of one step's losses on this rank (module docstring: the contract and its derivation).

    micro_num: micro-batches this rank runs in the step; dp: data-parallel ranks (each reads its own micro-batches);
    cp: context-parallel ranks (each holds a chunk of every micro-batch)."""

    micro_num: int
    dp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("micro_num", "dp", "cp"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"LossNormalizer.{name}: expected a positive int, got {getattr(self, name)!r}")

    @property
    def grad_divisor(self) -> int:
        """D = dp * cp: what FSDP divides the summed gradients by."""
        return grad_divisor(self.dp, self.cp)

    def weight(self, share: float = 1.0) -> float:
        """The weight of a chunk's token mean in L: s / M (M = dp * micro_num)."""
        return share / (self.micro_num * self.dp)

    @staticmethod
    def weighted(loss: torch.Tensor, share: Optional[Share]) -> torch.Tensor:
        """s * mu: a chunk's part of its micro-batch's mean (`loss` itself without context parallel)."""
        return loss if share is None else loss * share

    def backward_factor(self, scale: float = 1.0) -> float:
        """What each weighted chunk mean (`weighted`) is multiplied by before its backward: S * D * weight(1) =
        S * cp / micro_num, so that FSDP's mean over the D ranks leaves S * dL/dw."""
        return scale * self.cp / self.micro_num

    def aux_factor(self, scale: float = 1.0) -> float:
        """d(backpropagated)/d(aux) for a family's auxiliary losses: S / micro_num."""
        return scale / self.micro_num

    def rank_loss(self, weighted_sum: torch.Tensor) -> torch.Tensor:
        """This rank's part of the reported loss from the sum of its weighted chunk means (times dp; see
        `global_loss`)."""
        return weighted_sum / self.micro_num

    def global_loss(self, summed: torch.Tensor) -> torch.Tensor:
        """L from the sum of `rank_loss` over the "pp_dp" ranks."""
        return summed / self.dp
