"""Layers shared by the model families: RMSNorm, the CPU-aware linear, rotary embeddings."""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ..utils import cpu_features


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm under the package's dtype policy (numerics/precision.py): it returns its input's dtype, on
    every device and under autocast or not. CUDA's autocast would run `rms_norm` in fp32 and hand fp32 on (CPU's
    does not): twice the bytes of every norm output, and q/k in fp32 next to a bf16 v. Autocast is off inside, so
    torch's kernel runs on the input's dtype, its statistics (mean square, rsqrt) in fp32 for 16-bit inputs.
    fp32=True (InternLM's use_fp32_norm): the whole norm, weight multiply included, in fp32, then cast back."""

    def __init__(self, dim: int, eps: float, fp32: bool = False):
        super().__init__(dim, eps=eps)
        self.fp32 = fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            if self.fp32 and x.dtype != torch.float32:
                weight = self.weight.float() if self.weight is not None else None
                return F.rms_norm(x.float(), self.normalized_shape, weight, self.eps).to(x.dtype)
            return super().forward(x).to(x.dtype)


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


def cpu_half_gemm_upcast(dtype: torch.dtype) -> bool:
    """Linear layers of this 16-bit dtype run their GEMMs in fp32 (see HalfLinearFp32Gemm): the CPU (its features
    as utils/cpu_features.py holds them, pinnable) has no native GEMM for it. Without one oneDNN and MKL emulate
    16-bit GEMMs, and the backward's run ~100x slower than fp32 (0.3 GFLOP/s on an AVX2 EPYC)."""
    return cpu_features.current().upcasts(dtype)


class HalfLinearFp32Gemm(torch.autograd.Function):
    """A bf16/fp16 linear whose three GEMMs (forward, input and weight gradient) run in fp32.

    Same numbers as a native 16-bit GEMM, which also accumulates in fp32 and rounds the result once; the
    16-bit inputs are what autograd keeps, so activation memory is that of the 16-bit layer, plus one fp32
    copy of the operands while a GEMM runs. Works on DTensors (tensor parallel): every op is a torch op.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x.float(), weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad_out.float()
        grad_x = grad_w = None
        # a backward called inside autocast (on the CPU the engine keeps the caller's autocast state) would
        # cast these fp32 operands back to 16 bits
        with torch.autocast("cpu", enabled=False):
            if ctx.needs_input_grad[0]:
                grad_x = (g @ weight.float()).to(x.dtype)
            if ctx.needs_input_grad[1]:
                grad_w = (g.reshape(-1, g.shape[-1]).t() @ x.float().reshape(-1, x.shape[-1])).to(weight.dtype)
        return grad_x, grad_w


def weight_subclass(weight: torch.Tensor) -> bool:
    """A weight whose class (or, for an nn.Parameter, its data's) is a tensor subclass other than DTensor."""
    return type(weight) not in (torch.Tensor, nn.Parameter, DTensor)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear, with two CPU paths that compute the same numbers faster.

    Plain fp32 CPU tensors outside autocast: forward and backward on oneDNN's fp32 GEMM. torch runs fp32
    matmuls on MKL, which on some CPUs (AMD's, as here) takes an AVX2 code path; oneDNN, shipped inside torch
    and already used for bf16, runs AVX-512 and is about 2x faster for these shapes. Both are IEEE fp32
    (results differ by summation order only).
    bf16/fp16 on a CPU without native 16-bit GEMM (weights in 16 bits, or autocast to 16 bits): the GEMMs run
    in fp32 and round once (HalfLinearFp32Gemm), as a native kernel does; tensor-parallel DTensors included.
    Other devices (GPUs) always take F.linear, and so does a weight of a tensor subclass other than DTensor (a
    low-precision training wrapper such as torchao's MXFP8 weight, whose own F.linear override picks the GEMM; it
    multiplies only, torchao 0.18 drops a bias passed to it, so the bias is added here; it runs before autocast
    would cast, so autocast's cast of both operands is done here).
    """
    if weight_subclass(weight):
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight, bias = x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(x, weight)
            return y if bias is None else y + bias
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    autocast = torch.is_autocast_enabled("cpu")
    half = torch.get_autocast_dtype("cpu") if autocast else weight.dtype
    if cpu_half_gemm_upcast(half) and (autocast or x.dtype == half):
        with torch.autocast("cpu", enabled=False):
            y = HalfLinearFp32Gemm.apply(x.to(half), weight.to(half))
            return y if bias is None else y + bias.to(half)
    if (cpu_features.current().onednn_linear and x.dtype == torch.float32 and weight.dtype == torch.float32
            and not isinstance(weight, DTensor) and not isinstance(x, DTensor) and not autocast):
        y = onednn_matmul(x, weight)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose matmul is `linear` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


ROPE_SCALINGS = ("linear", "dynamic", "llama3", "yarn")
YARN_OPTIONS = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")


def rope_scaling_kind(scaling: Optional[Mapping[str, Any]]) -> str:
    """The kind of a `model.rope_scaling` dict: InternLM2's `type` or transformers' `rope_type` ("default": none)."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def scaled_inv_freq(head_dim: int, base: float, scaling: Mapping[str, Any], max_seqlen: int) -> torch.Tensor:
    """The inverse frequencies under `scaling`, as transformers' ROPE_INIT_FUNCTIONS compute them (same formulas,
    same order of operations):

        linear   inv_freq / factor (positions stretched by factor)
        dynamic  NTK: base * (factor * s / m - (factor - 1)) ** (d / (d - 2)), s = max(max_seqlen, m), m =
                 original_max_position_embeddings (default max_seqlen: no change); HF computes it for the current
                 length, here for the training length, so tables and HF agree on rows of max_seqlen tokens
        llama3   Llama 3.1's: wavelengths above original / low_freq_factor divided by factor, below
                 original / high_freq_factor kept, smoothly interpolated between
        yarn     YaRN's (yarn_inv_freq): interpolated below a ramp over the dimensions, extrapolated above it
    """
    kind = rope_scaling_kind(scaling)
    if kind == "yarn":
        return yarn_inv_freq(head_dim, base, scaling)[0]
    factor = float(scaling["factor"])
    arange = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32)
    if kind == "dynamic":
        original = int(scaling.get("original_max_position_embeddings") or max_seqlen)
        s = max(max_seqlen, original)
        base = base * ((factor * s / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (base ** (arange / head_dim))
    if kind == "linear":
        return inv_freq / factor
    if kind == "dynamic":
        return inv_freq
    if kind != "llama3":
        raise ValueError(f"model.rope_scaling: expected a type of {', '.join(ROPE_SCALINGS)}, got {kind!r}")
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    llama = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * llama / factor + smooth * llama
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, llama)


def yarn_inv_freq(head_dim: int, base: float, scaling: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies and attention factor (the scale of cos/sin), as transformers'
    _compute_yarn_parameters computes them: `factor`, `original_max_position_embeddings`; optional beta_fast (32),
    beta_slow (1), truncate (True), attention_factor (else from mscale / mscale_all_dim, else 0.1 ln(factor) + 1)."""
    factor, original = float(scaling["factor"]), int(scaling["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def rotary_tables(head_dim: int, max_seqlen: int, base: float, scaling: Optional[Mapping[str, Any]] = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_seqlen, head_dim] for rotate-half rotary embeddings, frequencies scaled by `scaling`
    (`model.rope_scaling`, see scaled_inv_freq; None: the original rotary embedding); YaRN also scales cos/sin
    by its attention factor, as transformers does."""
    kind, attention = rope_scaling_kind(scaling), 1.0
    if kind == "default":
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    elif kind == "yarn":
        inv_freq, attention = yarn_inv_freq(head_dim, base, scaling)  # type: ignore[arg-type]
    else:
        inv_freq = scaled_inv_freq(head_dim, base, scaling, max_seqlen)  # type: ignore[arg-type]
    freqs = torch.outer(torch.arange(max_seqlen, dtype=torch.float32), inv_freq)
    freqs = torch.cat((freqs, freqs), dim=-1)
    if attention != 1.0:
        return freqs.cos() * attention, freqs.sin() * attention
    return freqs.cos(), freqs.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]; cos/sin [B, T, 1, D] gathered at each token's position in its document.

    The fp32 tables are cast to x's dtype (as HF Llama does), so that bf16 q/k stay bf16 under
    autocast: flash-attn accepts only 16-bit inputs, and SDPA would otherwise copy them back.
    """
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
