"""Layers shared by the model families: RMSNorm, the CPU-aware linear, rotary embeddings."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm, optionally computed in fp32 under low-precision compute (InternLM's use_fp32_norm)."""

    def __init__(self, dim: int, eps: float, fp32: bool = False):
        super().__init__(dim, eps=eps)
        self.fp32 = fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32 and x.dtype != torch.float32:
            with torch.autocast(x.device.type, enabled=False):
                return super().forward(x.float()).to(x.dtype)
        return super().forward(x)


def _onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_ONEDNN_LINEAR = _onednn_linear_available()


@torch.library.custom_op("internlm_core::onednn_matmul", mutates_args=())
def onednn_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T with oneDNN's GEMM (strided views accepted); an opaque kernel to torch.compile."""
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


@onednn_matmul.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], w.shape[0])


def _onednn_matmul_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _onednn_matmul_backward(ctx, grad_out: torch.Tensor):
    """dx = dy @ w; dw = (x^T dy)^T, oneDNN's fast layout for a reduction over tokens."""
    x, w = ctx.saved_tensors
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_x = onednn_matmul(grad_out, w.t())
    if ctx.needs_input_grad[1]:
        grad_w = onednn_matmul(x.reshape(-1, x.shape[-1]).t(), grad_out.reshape(-1, grad_out.shape[-1]).t()).t()
    return grad_x, grad_w


onednn_matmul.register_autograd(_onednn_matmul_backward, setup_context=_onednn_matmul_setup)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear; for plain fp32 CPU tensors outside autocast, forward and backward on oneDNN's fp32 GEMM.

    torch runs fp32 matmuls on MKL, which on some CPUs (AMD's, as here) takes an AVX2 code path; oneDNN,
    shipped inside torch and already used for bf16, runs AVX-512 and is about 2x faster for these shapes.
    Both are IEEE fp32 (results differ by summation order only). DTensors (tensor parallel), other devices
    and dtypes, and autocast (whose bf16 matmuls already run on oneDNN) take F.linear.
    """
    if (_ONEDNN_LINEAR and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and not isinstance(weight, DTensor) and not isinstance(x, DTensor)
            and not torch.is_autocast_enabled("cpu")):
        y = onednn_matmul(x, weight)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose matmul is `linear` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def rotary_tables(head_dim: int, max_seqlen: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_seqlen, head_dim] for rotate-half rotary embeddings."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_seqlen, dtype=torch.float32), inv_freq)
    freqs = torch.cat((freqs, freqs), dim=-1)
    return freqs.cos(), freqs.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]; cos/sin [B, T, 1, D] gathered at each token's position in its document.

    The fp32 tables are cast to x's dtype (as HF Llama does), so that bf16 q/k stay bf16 under
    autocast: flash-attn accepts only 16-bit inputs, and SDPA would otherwise copy them back.
    """
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
