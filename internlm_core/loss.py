"""FlashGPTLMLoss: next-token cross entropy over packed rows (labels already shifted, -100 ignored).

The loss returns its side results (`LossSide`: per-token losses, argmax) with the loss instead of keeping them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from .fused_head import FusedHead
from .numerics.kernels import CROSS_ENTROPY as KERNELS

# Bytes of fp32 temporaries per chunk of the fused cross entropy. CPU: a chunk (rows * V * 4 bytes) stays in
# the caches instead of streaming [N, V] fp32 tensors through memory several times. CUDA: large enough that
# a micro-batch takes a handful of chunks (a few kernel launches each), small enough to add little memory.
_CHUNK_BYTES = 4 * 1024 * 1024
_CUDA_CHUNK_BYTES = 256 * 1024 * 1024

# fp16 logits: the stored gradient is (softmax - one_hot) * 2**15, not divided by the token count. Its entries
# lie in [-2**15, 2**15] and keep full fp16 precision down to 2**-14 / 2**15 instead of vanishing once divided by
# thousands of tokens before the loss scale reaches them; backward applies 2**-15 * (the incoming gradient: loss
# scale / (micro-batches * count)) in fp32 before the one rounding. bf16 has fp32's exponent range and stores
# (softmax - one_hot) / count like fp32.
_FP16_SHIFT = 15


def _chunk_rows(v: int, device: torch.device) -> int:
    return max(1, (_CUDA_CHUNK_BYTES if device.type == "cuda" else _CHUNK_BYTES) // (4 * v))


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
    when the logits need a gradient, already the gradient of each token's loss, stored in the logits' dtype
    (0 on ignored rows); the backward only scales it by the incoming gradient. No fp32 [N, V] tensor is ever
    materialized. Equal to F.cross_entropy(logits.float(), reduction="none") up to rounding; the argmax feeds
    the accuracy metric.

    fp32 and bf16 logits store (softmax - one_hot) / count, the gradient of the mean; fp16 logits store
    (softmax - one_hot) * 2**15 (see _FP16_SHIFT): divided by the count before the loss scale reached it, fp16
    would flush most entries to 0. The backward scales the stored rows in fp32 without host synchronization.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, compiled: bool = False):  # noqa: D102
        n, v = logits.shape
        dev = logits.device
        losses = torch.empty(n, dtype=torch.float32, device=dev)
        argmax = torch.empty(n, dtype=torch.long, device=dev)
        valid = labels != -100
        safe = torch.where(valid, labels, 0)
        count = valid.sum().clamp(min=1)  # a tensor: no host synchronization on CUDA
        # per row: the factor of (softmax - one_hot) that is stored, and its inverse (applied in backward)
        if logits.dtype == torch.float16:
            weight, ctx.inverse = valid.float() * 2.0**_FP16_SHIFT, 2.0**-_FP16_SHIFT
        else:
            weight, ctx.inverse = valid.float() / count, None  # None: the count, read in backward
        want_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(logits) if want_grad else None
        step = _chunk_rows(v, dev)
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
        ctx.save_for_backward(grad, valid, count)
        ctx.consumed = False
        ctx.mark_non_differentiable(argmax)
        return losses, argmax

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor, _grad_argmax: Optional[torch.Tensor]):  # noqa: D102
        """Each stored row times its token's incoming gradient over the stored weight, on the device: no host
        synchronization (the fp32 path read the count and the incoming gradient on the host, 3-4 per micro-batch)."""
        grad, valid, count = ctx.saved_tensors
        if grad.dtype in (torch.float16, torch.bfloat16):
            inverse = ctx.inverse if ctx.inverse is not None else count.float()
            return _scale_stored_gradient(ctx, grad, grad_losses.float() * inverse), None, None
        # fp32 stores (softmax - one_hot) / count: the factor is (incoming gradient) * count, which for the mean (and a
        # power-of-two loss scale or micro_num) is a power of two up to the rounding of 1 / count: snapped to it, so
        # that the mean's gradient is the stored one, rounded once, and the others are exact multiples of it (any other
        # factor, as token_mean's count * S * D / N mostly is, stays; one within 1e-6 of a power of two moves by that)
        factor = _snap_to_powers_of_two(grad_losses.double() * count.double())
        return _scale_stored_gradient(ctx, grad, factor.float()), None, None


def _snap_to_powers_of_two(f: torch.Tensor) -> torch.Tensor:
    """`f` with every value within 1e-6 (relative) of a power of two (or its negative) set to it; on the device."""
    m, e = torch.frexp(f)  # f = m * 2**e, |m| in [0.5, 1): exact
    a = m.abs()
    low = torch.ldexp(torch.sign(m) * 0.5, e)  # |f| just above a power of two
    high = torch.ldexp(torch.sign(m), e)  # |f| just below one
    return torch.where((a - 0.5) < 5e-7, low, torch.where((1.0 - a) < 1e-6, high, f))


def _scale_stored_gradient(ctx, grad: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """The logits' gradient: the stored rows times `factor` (fp32 [N]: each token's incoming gradient over the
    stored weight), multiplied in fp32 chunk by chunk and (16-bit) rounded once, into the stored buffer (a second
    backward through the same graph would find it overwritten, hence the check)."""
    if ctx.consumed:
        raise RuntimeError("the fused cross entropy's backward ran twice on one graph (retain_graph); "
                           "use the 'torch' cross entropy kernel for that")
    ctx.consumed = True
    step = _chunk_rows(grad.shape[1], grad.device)
    for s in range(0, grad.shape[0], step):
        e = min(s + step, grad.shape[0])
        if grad.dtype == torch.float32:
            grad[s:e].mul_(factor[s:e].unsqueeze(1))
        else:
            grad[s:e] = grad[s:e].float().mul_(factor[s:e].unsqueeze(1))
    return grad


@dataclass
class LossSide:
    """What a loss call finds on the way, for the metrics (AccPerplex) so that they need not recompute it.

    token_losses: the detached per-token cross entropy (fp32, 0 where the label is -100); None under label
        smoothing, whose per-token loss is not the cross entropy perplexity is made of.
    predictions: the argmax of every row when the kernel computed it (the fused kernels), else None.
    """

    token_losses: Optional[torch.Tensor] = None
    predictions: Optional[torch.Tensor] = None


class FlashGPTLMLoss(nn.Module):
    """Mean cross entropy over tokens whose label is not -100: `loss, side = loss_fn(logits, labels)`. The loss
    contract's token_mean (loss_norm.py) takes the sum as this mean times the count, on the device (`part`).

    `kernel` is the decision of `numerics.select_kernels` (see numerics/kernels.py): "flash" (flash-attn's
    Triton kernel, in-place backward), "fused_chunked" / "fused_chunked_compiled" (`_ChunkedCrossEntropy`, no
    label smoothing), "torch" (F.cross_entropy on fp32 logits) or "vocab_parallel" (tensor parallel with
    `parallel_output`: the logits arrive vocabulary-sharded as a DTensor and torch's `loss_parallel` context
    computes the softmax without gathering them; sharded logits always take this path). Without `kernel`:
    fused_chunked, or torch under label smoothing (`use_flash=False`, the older spelling, also means torch).
    """

    def __init__(self, kernel: Optional[str] = None, label_smoothing: float = 0.0, use_flash: Optional[bool] = None):
        super().__init__()
        self.label_smoothing = float(label_smoothing)
        if kernel is None:
            kernel = "torch" if (use_flash is False or self.label_smoothing) else "fused_chunked"
        if kernel not in KERNELS:
            raise ValueError(f"cross entropy kernel: expected one of {', '.join(KERNELS)}, got {kernel!r}")
        if kernel.startswith("fused_chunked") and self.label_smoothing:
            raise ValueError(f"cross entropy kernel {kernel!r} has no label smoothing; use 'torch' or 'flash'")
        self.kernel = kernel
        self.fused_head: Optional[FusedHead] = None  # model.fused_head_loss: the loss applies the output layer
        self.z_loss = 0.0  # the fused head's z-loss coefficient (z * logsumexp^2 per token)
        self._flash = None
        if kernel == "flash":
            from flash_attn.losses.cross_entropy import CrossEntropyLoss
            # in-place backward: the logits' gradient overwrites the logits (no second [N, V] buffer), as InternLM
            self._flash = CrossEntropyLoss(ignore_index=-100, reduction="none", label_smoothing=self.label_smoothing,
                                           inplace_backward=True)

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, LossSide]:
        logits = logits.reshape(-1, logits.shape[-1])
        labels = labels.reshape(-1)
        predictions = None
        if isinstance(logits, DTensor) or self.kernel == "vocab_parallel":
            token_losses = vocab_parallel_cross_entropy(logits, labels, self.label_smoothing)
        elif self._flash is not None:
            token_losses = self._flash(logits, labels)
        elif self.kernel != "torch":  # one pass over the logits for loss, argmax and gradient
            token_losses, predictions = _ChunkedCrossEntropy.apply(logits, labels, self.kernel != "fused_chunked")
        else:  # fp32 softmax: a bf16 log-softmax over a large vocabulary loses too much precision
            token_losses = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="none",
                                           label_smoothing=self.label_smoothing)
        # sum / count instead of reduction="mean": a row with no valid label gives 0, not nan
        count = (labels != -100).sum().clamp(min=1)
        side = LossSide(token_losses.detach() if self.label_smoothing == 0 else None, predictions)
        return token_losses.sum() / count, side


    def fused(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, LossSide]:
        """The loss of the output layer's input `hidden` through `self.fused_head` (fused_head.py: the logits
        never whole), with label smoothing and z-loss; the side results are the plain cross entropy and argmax."""
        labels = labels.reshape(-1)
        token_losses, ce, predictions = self.fused_head(hidden, labels, self.label_smoothing, self.z_loss)
        count = (labels != -100).sum().clamp(min=1)
        return token_losses.sum() / count, LossSide(ce, predictions)


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
