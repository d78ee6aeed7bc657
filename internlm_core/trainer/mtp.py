"""model.mtp's part of the step (model/mtp.py): each micro-batch's depth targets, made from the whole rows before
any context-parallel cut; each depth's loss under the loss contract; the `mtp_loss` metric.

The trained loss is L + loss_weight * (1 / D) * sum_k L_k, where L_k is depth k's cross entropy under the same
contract as the main loss L (loss.reduction, loss_norm.py), over the depth's own counted targets: each depth gets
the normalizer the loss contract makes for its labels (`LossNormalizer.of_step`: under token_mean its own global
count N_k, one more small all-reduce per depth and step; under micro_batch_mean its own context shares), and its
terms (`part`) are backpropagated with the main loss's factor times backward_factor_k / backward_factor (N / N_k
under token_mean, 1 under micro_batch_mean), so that each depth enters exactly as its own L_k.
`mtp_loss` reports (1 / D) * sum_k L_k (before loss_weight), reduced as the loss is (one more small all-reduce and
host read per step when model.mtp is on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config import Config
from ..config.schema import ModelConfig
from ..distributed import ParallelDims
from ..errors import ConfigError
from ..loss import FlashGPTLMLoss
from ..loss_norm import LossNormalizer
from ..model import document_ids_from_cu_seqlens
from ..model.mtp import (MTP_KEYS, MultiTokenPrediction, model_extras, mtp_module, mtp_settings, mtp_targets,
                         pop_mtp_logits)
from ..utils import collectives
from ..utils.transfer import to_device

__all__ = ["MTP_KEYS", "MTPLoss", "build_mtp_loss", "check_family_mtp", "model_extras"]


@dataclass
class MTPLoss:
    """The MTP depths' loss of this rank's steps; `module` None on pipeline ranks without the last stage.

    reduction: loss.reduction; dims: the run's ParallelDims (dp, cp, their groups); loss_fn: a FlashGPTLMLoss of
    the run's kernel (the same numerics and vocabulary-parallel handling as the main loss)."""

    depth: int
    loss_weight: float
    loss_fn: FlashGPTLMLoss
    module: Optional[MultiTokenPrediction]
    reduction: str
    dims: ParallelDims
    device: torch.device
    _step: list = field(default_factory=list, repr=False)       # this step's targets, one (ids, labels) per micro-batch
    _norms: list = field(default_factory=list, repr=False)      # this step's normalizer of each depth
    _totals: Optional[torch.Tensor] = field(default=None, repr=False)  # [D]: each depth's terms summed

    def targets(self, batch: dict, i: int, mb: dict, seq_len: int) -> dict:
        """Micro-batch `i` of `batch` (`mb`: its whole rows [rows, T] and cu_seqlens, on the host) with its depths'
        `mtp_ids` and `mtp_labels` [rows, T, D]. At i = 0 the step's targets of every micro-batch are made and each
        depth's normalizer counted from them (before the first backward, as the main loss's)."""
        if i == 0:  # a new step, or a retry of one the replica groups did not commit: its terms count anew
            self._step, self._totals = [], None
            for j in range(batch["input_ids"].shape[0]):
                rows = batch["input_ids"][j].numel() // seq_len
                ids, labels = batch["input_ids"][j].view(rows, seq_len), batch["labels"][j].view(rows, seq_len)
                docs = document_ids_from_cu_seqlens(batch["cu_seqlens"][j], rows, seq_len)
                self._step.append(mtp_targets(ids, labels, docs, self.depth))
            every = torch.stack([labels for _, labels in self._step])  # [n, rows, T, D]
            self._norms = [LossNormalizer.of_step(self.reduction, len(self._step), self.dims, every[..., k],
                                                  self.device) for k in range(self.depth)]
        ids, labels = self._step[i]
        return {**mb, "mtp_ids": ids, "mtp_labels": labels}

    def term(self, norm: LossNormalizer, labels: torch.Tensor,
             shares: Optional[Sequence[float] | torch.Tensor] = None) -> torch.Tensor:
        """What the depths add to the main loss's term before its backward (module docstring), for the depths'
        logits of the forward just run (`labels` [.., D] their targets; `shares` each depth's context share, a
        list or a [D] device tensor, or None); 0 when that forward ran no depth. Its value counts towards `mtp_loss`."""
        logits = pop_mtp_logits(self.module)
        if not logits:
            return torch.zeros((), device=self.device)
        parts = [n.part(self.loss_fn(lg, labels[..., k])[0], labels[..., k], None if shares is None else shares[k])
                 for k, (lg, n) in enumerate(zip(logits, self._norms))]
        done = torch.stack([p.detach() for p in parts])
        self._totals = done if self._totals is None else self._totals + done
        # N / N_k under token_mean (0-dim device tensors: no host read), 1.0 under micro_batch_mean
        ratios = [n.backward_factor(1.0) / norm.backward_factor(1.0) for n in self._norms]
        return self.loss_weight * sum(p * r for p, r in zip(parts, ratios)) / self.depth

    def term_at(self, norm: LossNormalizer, stacked: dict, index: torch.Tensor) -> torch.Tensor:
        """`term` of pipeline micro-batch `index` (a 0-dim device tensor: no host read) of the step's stacked
        micro-batches (parallel.pipeline.stack_micro_batches: `mtp_labels` [micro_num * rows, T, D] on the device,
        `mtp_shares` [micro_num, D] each depth's context share, copied to the device at the first call). torch's
        metadata inference (a forward and backward of the first micro-batch on torch 2.13, whose gradients are
        discarded) leaves its depths' logits pending without a term: the next forward of the last stage replaces
        them."""
        if self.module is None:
            return torch.zeros((), device=self.device)
        labels, at = stacked["mtp_labels"], index.reshape(1).long()
        labels = labels.view(norm.micro_num, -1, *labels.shape[1:])
        shares = stacked["mtp_shares"] = to_device(stacked["mtp_shares"], self.device)  # once per step
        return self.term(norm, labels.index_select(0, at)[0], shares.index_select(0, at)[0])

    def step_metrics(self, dims: ParallelDims) -> dict[str, float]:
        """{"mtp_loss": the step's (1 / D) * sum_k L_k}, reduced over "pp_dp" as the loss (every rank calls)."""
        totals = self._totals if self._totals is not None else torch.zeros(self.depth, device=self.device)
        if self._norms:
            totals = torch.stack([n.rank_loss(t) for n, t in zip(self._norms, totals)])
        totals = totals.float().clone()
        if dims.pp_dp > 1:
            collectives.all_reduce(totals, op=dist.ReduceOp.SUM, group=dims.group("pp_dp"))
        self._totals = None
        norm = self._norms[0] if self._norms else LossNormalizer(1, dims.dp, dims.cp)  # global_loss: / dp
        return {"mtp_loss": float(norm.global_loss(totals.sum()) / self.depth)}  # the depths' mean


def build_mtp_loss(cfg: Config, model: nn.Module, loss_fn: FlashGPTLMLoss, dims: ParallelDims,
                   device: torch.device) -> Optional[MTPLoss]:
    """The trainer's MTPLoss when model.mtp is on (None otherwise); `model`: this rank's (parallelized) model."""
    settings = mtp_settings(cfg.model.mtp)
    if not settings.on:
        return None
    return MTPLoss(settings.depth, settings.loss_weight, loss_fn, mtp_module(model), cfg.loss.reduction, dims, device)


def check_family_mtp(model_cfg: ModelConfig, model_type: str, model: nn.Module) -> None:
    """ConfigError when model.mtp is on and the family's module (`model`, whole, before any split) built no depths."""
    if mtp_settings(model_cfg.mtp).on and mtp_module(model) is None:
        raise ConfigError(f"model.mtp: model_type {model_type} builds no multi-token prediction depths "
                          f"(its module does not use model/mtp.py)")
