"""FlashGPTLMLoss: next-token cross entropy over packed rows (labels already shifted, -100 ignored)."""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from .utils.logging import get_logger

logger = get_logger(__name__)


def _flash_cross_entropy() -> Optional[type]:
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn.losses.cross_entropy import CrossEntropyLoss
    except Exception:  # flash-attn built without its cross-entropy extension
        return None
    return CrossEntropyLoss


class FlashGPTLMLoss(nn.Module):
    """Mean cross entropy over tokens whose label is not -100.

    Uses flash-attn's fused cross entropy on CUDA when installed, torch's otherwise. Under tensor
    parallel with `parallel_output=True` the logits arrive vocab-sharded (a DTensor) and torch's
    `loss_parallel` context computes the same value without gathering them (see parallel/).
    `last_token_losses` keeps the detached per-token losses of the last call (0 where ignored) so
    that metrics need not recompute the cross entropy.
    """

    def __init__(self, parallel_output: bool = True, label_smoothing: float = 0.0, use_flash: Optional[bool] = None):
        super().__init__()
        self.parallel_output = parallel_output
        self.label_smoothing = float(label_smoothing)
        flash_cls = _flash_cross_entropy() if use_flash in (None, True) else None
        self._flash = flash_cls(ignore_index=-100, reduction="none", label_smoothing=self.label_smoothing) \
            if flash_cls is not None else None
        self.last_token_losses: Optional[torch.Tensor] = None

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = logits.reshape(-1, logits.shape[-1])
        labels = labels.reshape(-1)
        if isinstance(logits, DTensor):  # vocabulary-parallel logits (tensor parallel, parallel_output)
            token_losses = vocab_parallel_cross_entropy(logits, labels, self.label_smoothing)
        elif self._flash is not None and logits.is_cuda:
            token_losses = self._flash(logits, labels)
        else:
            # fp32 softmax: bf16 log-softmax over a large vocabulary loses too much precision
            token_losses = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="none",
                                           label_smoothing=self.label_smoothing)
        self.last_token_losses = token_losses.detach()
        # sum / count instead of reduction="mean": a row with no valid label gives 0, not nan
        count = (labels != -100).sum().clamp(min=1)
        return token_losses.sum() / count


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value as a plain tensor (no communication when replicated); autograd flows through."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def vocab_parallel_cross_entropy(logits: DTensor, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token cross entropy (fp32, 0 where the label is -100) of logits sharded along the vocabulary.

    Must run, with its backward, under `torch.distributed.tensor.parallel.loss_parallel()`: the softmax
    statistics are all-reduced over the tensor-parallel ranks instead of gathering [N, V] logits.
    loss_parallel has no label smoothing; it is added here as torch computes it:
    (1 - e) * nll + e * mean over the vocabulary of -log p, with mean(-log p) = logsumexp(x) - mean(x).
    (Not from log_softmax: under loss_parallel its backward is fused into nll_loss's and would be wrong
    for any other use of its output.)
    """
    logits = logits.float()
    nll = _plain(F.cross_entropy(logits, labels, ignore_index=-100, reduction="none"))
    if label_smoothing == 0:
        return nll
    peak = logits.detach().amax(dim=-1, keepdim=True)
    logsumexp = (logits - peak).exp().sum(dim=-1).log() + peak.squeeze(-1)
    smooth = _plain(logsumexp - logits.sum(dim=-1) / logits.shape[-1])
    return (1.0 - label_smoothing) * nll + label_smoothing * smooth * (labels != -100)
