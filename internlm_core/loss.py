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


# Rows of logits per chunk of the fused cross entropy: a chunk's fp32 temporaries (rows * V * 4 bytes) stay in
# the CPU's caches instead of streaming [N, V] fp32 tensors through memory several times.
_CHUNK_BYTES = 4 * 1024 * 1024


def _cross_entropy_chunk(x: torch.Tensor, label: torch.Tensor, valid: torch.Tensor, weight: torch.Tensor,
                         want_grad: bool) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """One chunk of `_ChunkedCrossEntropy.forward` written functionally, for torch.compile: per-token loss,
    argmax and (if want_grad) weight * (softmax - one_hot) in x's dtype. Inductor fuses it into a few
    vectorized loops over each row (max/argmax, sum of exp, gradient) where eager runs one pass per op.
    Eager runs keep the in-place loop of the forward instead: 1.5-2.4x faster than this without compile."""
    xf = x.float()
    m, argmax = xf.max(dim=-1)
    e = (xf - m.unsqueeze(1)).exp()
    total = e.sum(dim=-1)
    picked = xf.gather(1, label.unsqueeze(1)).squeeze(1)
    loss = torch.where(valid, total.log() + m - picked, 0.0)
    if not want_grad:
        return loss, argmax, None
    g = e * (weight / total).unsqueeze(1)
    hit = torch.arange(x.shape[1], device=x.device).unsqueeze(0) == label.unsqueeze(1)
    return loss, argmax, torch.where(hit, g - weight.unsqueeze(1), g).to(x.dtype)


_COMPILED_CHUNK = None


def _compiled_chunk():
    """`_cross_entropy_chunk` under torch.compile, built on first use (shapes static: the chunk size and the
    last, shorter chunk each compile once)."""
    global _COMPILED_CHUNK
    if _COMPILED_CHUNK is None:
        _COMPILED_CHUNK = torch.compile(_cross_entropy_chunk, dynamic=False)
    return _COMPILED_CHUNK


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy (fp32, 0 where the label is -100) and the argmax of every row, in one pass.

    Chunk by chunk of rows, the forward computes the row max (and argmax), the log-sum-exp, the loss and,
    when the logits need a gradient, already the gradient of the loss of each token, softmax - one_hot
    (0 on ignored rows), in the logits' dtype; the backward only scales it by the incoming gradient
    (one multiply instead of recomputing the softmax). No fp32 [N, V] tensor is ever materialized. Equal to
    F.cross_entropy(logits.float(), reduction="none") up to rounding; the argmax feeds the accuracy metric.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, compiled: bool = False):  # noqa: D102
        n, v = logits.shape
        dev = logits.device
        losses = torch.empty(n, dtype=torch.float32, device=dev)
        argmax = torch.empty(n, dtype=torch.long, device=dev)
        valid = labels != -100
        safe = torch.where(valid, labels, 0)
        count = max(1, int(valid.sum()))
        weight = valid.float() / count  # the gradient of the mean over valid tokens, the usual loss
        want_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(logits) if want_grad else None
        step = max(1, _CHUNK_BYTES // (4 * v))
        rows = torch.arange(min(step, n), device=dev)
        chunk_fn = _compiled_chunk() if compiled else None
        for s in range(0, n, step):
            e = min(s + step, n)
            if chunk_fn is not None:
                losses[s:e], argmax[s:e], g = chunk_fn(logits[s:e], safe[s:e], valid[s:e], weight[s:e], want_grad)
                if want_grad:
                    grad[s:e] = g
                continue
            x = logits[s:e].float()
            m, argmax[s:e] = x.max(dim=-1)
            picked = x.gather(1, safe[s:e].unsqueeze(1)).squeeze(1)
            p = (x - m.unsqueeze(1)).exp_()
            total = p.sum(dim=-1)
            losses[s:e] = torch.where(valid[s:e], total.log().add_(m) - picked, 0.0)
            if want_grad:
                p.mul_((weight[s:e] / total).unsqueeze(1))  # softmax, 0 on ignored rows
                p[rows[: e - s], safe[s:e]] -= weight[s:e]
                grad[s:e] = p
        ctx.save_for_backward(grad, valid)
        ctx.count = count
        ctx.mark_non_differentiable(argmax)
        return losses, argmax

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor, _grad_argmax: Optional[torch.Tensor]):  # noqa: D102
        grad, valid = ctx.saved_tensors
        g = grad_losses[valid]
        if g.numel() == 0:
            return torch.zeros_like(grad), None, None
        if bool((g == g[0]).all()):  # a sum or mean of the losses: one factor relative to the mean's gradient
            factor = g[0].item() * ctx.count
            if abs(factor - 1.0) < 1e-6:  # the mean itself: the gradient as computed, rounded once
                return grad, None, None
            return grad * factor, None, None  # exact for powers of two (micro_num 2, 4, ..., loss scales)
        return (grad.float() * (grad_losses.float() * ctx.count).unsqueeze(1)).to(grad.dtype), None, None


class FlashGPTLMLoss(nn.Module):
    """Mean cross entropy over tokens whose label is not -100.

    Uses flash-attn's fused cross entropy on CUDA when installed, a chunked fused one on CPU (no label
    smoothing; `use_flash=False` forces torch's everywhere), torch's otherwise. Under tensor
    parallel with `parallel_output=True` the logits arrive vocab-sharded (a DTensor) and torch's
    `loss_parallel` context computes the same value without gathering them (see parallel/).
    `last_token_losses` keeps the detached per-token losses of the last call (0 where ignored) so
    that metrics need not recompute the cross entropy; `last_predictions` the argmax of each row when the
    fused CPU kernel computed it on the way (else None). `compiled=True` (model.compile) runs the CPU kernel's
    chunks through torch.compile.
    """

    def __init__(self, parallel_output: bool = True, label_smoothing: float = 0.0, use_flash: Optional[bool] = None,
                 compiled: bool = False):
        super().__init__()
        self.compiled = compiled
        self.parallel_output = parallel_output
        self.label_smoothing = float(label_smoothing)
        flash_cls = _flash_cross_entropy() if use_flash in (None, True) else None
        self._flash = flash_cls(ignore_index=-100, reduction="none", label_smoothing=self.label_smoothing) \
            if flash_cls is not None else None
        self.use_flash = use_flash
        self.last_token_losses: Optional[torch.Tensor] = None
        self.last_predictions: Optional[torch.Tensor] = None

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = logits.reshape(-1, logits.shape[-1])
        labels = labels.reshape(-1)
        self.last_predictions = None
        if isinstance(logits, DTensor):  # vocabulary-parallel logits (tensor parallel, parallel_output)
            token_losses = vocab_parallel_cross_entropy(logits, labels, self.label_smoothing)
        elif self._flash is not None and logits.is_cuda:
            token_losses = self._flash(logits, labels)
        elif self.label_smoothing == 0 and self.use_flash is not False and logits.device.type == "cpu":
            # fused on CPU: one pass over the logits for loss and argmax, no fp32 log-softmax kept
            token_losses, argmax = _ChunkedCrossEntropy.apply(logits, labels, self.compiled)
            self.last_predictions = argmax
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
