"""The InternLM transformer family, readable top to bottom.

INTERNLM (v1): RMSNorm, rotary, SwiGLU FFN (width from mlp_ratio), bias on q/k/v/o.
INTERNLM2 / LLAMA: the same block with grouped-query attention and no bias.

Parameter names are stable across every parallel layout (`layers` is a ModuleDict keyed "0", "1", ...
so that pipeline stages keep the names of the layers they own); checkpoints and HF export rely on that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from .attention import PackedMeta, attention, build_packed_meta


@dataclass
class ModelArgs:
    """The shape and numerics of one model, resolved from the config."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_width: int
    max_seqlen: int
    qkv_bias: bool = False
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    tie_word_embeddings: bool = False
    init_std: float = 0.02
    embed_grad_scale: float = 1.0
    apply_post_layer_norm: bool = False
    use_fp32_norm: bool = False
    attn_backend: str = "sdpa"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


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


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.head_dim, self.backend = a.head_dim, a.attn_backend
        self.wq = Linear(a.hidden_size, a.num_heads * a.head_dim, bias=a.qkv_bias)
        self.wk = Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.wv = Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.wo = Linear(a.num_heads * a.head_dim, a.hidden_size, bias=a.qkv_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: PackedMeta) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallel each rank holds only its own heads
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attention(q, k, v, meta, self.backend)
        return self.wo(out.reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: w3(silu(w1 x) * w2 x), InternLM's naming."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.w1 = Linear(a.hidden_size, a.ffn_width, bias=False)
        self.w2 = Linear(a.hidden_size, a.ffn_width, bias=False)
        self.w3 = Linear(a.ffn_width, a.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


class TransformerBlock(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(a.hidden_size, a.norm_eps, a.use_fp32_norm)
        self.attention = Attention(a)
        self.ffn_norm = RMSNorm(a.hidden_size, a.norm_eps, a.use_fp32_norm)
        self.feed_forward = FeedForward(a)
        self.post_norm = a.apply_post_layer_norm
        self.use_checkpoint = False  # set by activation checkpointing (model.checkpoint)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: PackedMeta) -> torch.Tensor:
        if self.post_norm:
            x = self.attention_norm(x + self.attention(x, cos, sin, meta))
            return self.ffn_norm(x + self.feed_forward(x))
        x = x + self.attention(self.attention_norm(x), cos, sin, meta)
        return x + self.feed_forward(self.ffn_norm(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: PackedMeta) -> torch.Tensor:
        if self.use_checkpoint and torch.is_grad_enabled():
            return activation_checkpoint(self._forward, x, cos, sin, meta, use_reentrant=False)
        return self._forward(x, cos, sin, meta)


class Transformer(nn.Module):
    """Embedding → blocks → norm → output. Any of them may be None on a pipeline stage that lacks it."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.tok_embeddings: Optional[nn.Embedding] = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(a) for i in range(a.num_layers)})
        self.norm: Optional[RMSNorm] = RMSNorm(a.hidden_size, a.norm_eps, a.use_fp32_norm)
        self.output: Optional[nn.Linear] = Linear(a.hidden_size, a.vocab_size, bias=False)
        if a.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rotary_tables(a.head_dim, a.max_seqlen, a.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, buffer_device: Optional[torch.device] = None) -> None:
        """N(0, init_std) matrices, zero biases, unit norms; also rebuilds the rotary tables (after meta init)."""
        a = self.args
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=a.init_std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.RMSNorm):
                nn.init.ones_(m.weight)
        device = buffer_device or self.rope_cos.device
        if device.type != "meta":
            cos, sin = rotary_tables(a.head_dim, a.max_seqlen, a.rope_base)
            self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids [B, T] → logits [B, T, V]; on a later pipeline stage the input is the previous stage's
        hidden states (under sequence parallel [B, T / tensor, hidden]) and position_ids are required.

        position_ids: [B, T] position of each token in its document (default 0..T-1 per row).
        cu_seqlens: int32 document offsets over the flattened B*T tokens (default: one document per row),
        or document_ids: [B, T] the document of each token (see attention.py).
        """
        if position_ids is None:
            if self.tok_embeddings is None:
                raise ValueError("position_ids are required when the input is hidden states (a later pipeline stage)")
            B, T = input_ids.shape
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        B, T = position_ids.shape
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(input_ids)
            s = self.args.embed_grad_scale
            if s != 1.0:  # InternLM's embed_grad_scale: same forward, scaled gradient into the embedding
                h = s * h + (1.0 - s) * h.detach()
        else:
            h = input_ids
        cos = self.rope_cos[position_ids].unsqueeze(2)
        sin = self.rope_sin[position_ids].unsqueeze(2)
        meta = build_packed_meta(cu_seqlens, B, T, self.args.attn_backend, h.device, document_ids)
        for layer in self.layers.values():
            h = layer(h, cos, sin, meta)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def analytic_parameter_count(a: ModelArgs) -> int:
    """The parameter count from the shape alone (checks `count_parameters` and feeds FLOPs estimates)."""
    h, kv = a.hidden_size, a.num_kv_heads * a.head_dim
    attn = h * h + 2 * h * kv + h * h + (h + 2 * kv + h if a.qkv_bias else 0)
    ffn = 3 * h * a.ffn_width
    per_layer = attn + ffn + 2 * h
    embed = a.vocab_size * h
    head = 0 if a.tie_word_embeddings else a.vocab_size * h
    return a.num_layers * per_layer + embed + head + h


def flops_per_token(a: ModelArgs, seq_len: int) -> int:
    """Model FLOPs per trained token: 6*N_nonembedding (lm_head included) + 12*L*h*s.

    The PaLM convention, as the peer benchmark: the input embedding is a lookup and not counted,
    attention scores and values count the full s*s square (not halved for causal), activation
    recomputation is not counted (model FLOPs, not hardware FLOPs).
    """
    n = analytic_parameter_count(a) - a.vocab_size * a.hidden_size
    if a.tie_word_embeddings:  # the shared matrix is still used as the lm_head matmul
        n += a.vocab_size * a.hidden_size
    return 6 * n + 12 * a.num_layers * a.hidden_size * seq_len

