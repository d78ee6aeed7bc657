"""DeepSeek-V3's transformer (also Kimi-K2's and Moonlight's): multi-head latent attention (MLA) and an MoE stack
whose first blocks are dense.

Multi-head latent attention, per block (names ours; Hugging Face's in hf.py):

    q       wq_b(q_a_norm(wq_a x))  (q_lora_rank set: low-rank query)  or  wq x  (q_lora_rank None: Moonlight)
            [B, T, H, nope + rope], split into q_nope [.., nope] and q_rope [.., rope]
    latent  wkv_a x = [c_kv (kv_lora_rank), k_rope (rope)]; k_rope is ONE rotary key shared by every head
    k, v    wkv_b(kv_a_norm(c_kv)) = [k_nope (nope), v (v_head_dim)] per head
    attn    softmax(q k^T * scale) v, q = [q_nope, rot(q_rope)], k = [k_nope, rot(k_rope)] (the rope key repeated
            over the heads), scale = (nope + rope)^-0.5 * mscale^2 (YaRN's mscale_all_dim, as transformers'
            yarn_apply_mscale; 1 without YaRN), applied by scaling q so that every attention kernel's own
            (nope + rope)^-0.5 is the rest
    out     wo(attn) [B, T, h]

The rotary tables are the shared ones (layers.rotary_tables, YaRN included) over the rope channels only (rotate-half:
hf.py de-interleaves DeepSeek's interleaved rope weights on import). The low-rank norms have eps 1e-6 whatever
model.layer_norm_epsilon (transformers' DeepseekV3RMSNorm(q_lora_rank) / (kv_lora_rank) defaults).

Attention goes through the run's kernel (model/attention.py); v's head dim (v_head_dim) differs from q/k's
(nope + rope): sdpa and cpu_blocked take that as it is, flash, torch_varlen and the context-parallel kernels take
one head dim for q, k and v, so v is padded with zeros to q's width there and the output cut back (exact; logged
once per model).

The FFN of block i is the dense SwiGLU (width intermediate_size, InternLM's names w1/w2/w3) for the blocks
LayerMix makes dense (first_k_dense_replace), else the MoE layer (model/moe/) with DeepSeek's routing: sigmoid
scores, group-limited top-k, the selection bias, routed_scaling_factor, and shared experts added (not mixed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...utils.logging import get_logger
from ..args import ModelArgs
from ..attention import PackedMeta, attention
from ..internlm.model import FeedForward
from ..internlm_moe.model import MoEModelArgs, MoETransformer
from ..layers import Linear, RMSNorm, apply_rotary

logger = get_logger(__name__)

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, which its q_a / kv_a norms keep
# the kernels that take one head dim for q, k and v: v is padded to q's there
PADDED_V = ("flash", "torch_varlen")


@dataclass
class LatentAttentionArgs:
    """MLA's shape: q_lora_rank (None: a full-rank wq), kv_lora_rank, the per-head channels without and with
    rotary (qk_nope_head_dim, qk_rope_head_dim) and v's (v_head_dim); softmax_scale_factor: mscale^2 of YaRN's
    mscale_all_dim (1.0 without)."""

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale_factor: float = 1.0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass
class DeepSeekV3Args(MoEModelArgs):
    """The MoE args plus the latent attention's (`mla`); `attention_head_dim` is the rotary width
    (qk_rope_head_dim), so that the shared rotary tables cover the rope channels only."""

    mla: Optional[LatentAttentionArgs] = None

    # the `model` keys a Hugging Face folder fixes, read off the built model (model/foreign_keys.args_value)
    q_lora_rank = property(lambda self: self.mla.q_lora_rank)
    kv_lora_rank = property(lambda self: self.mla.kv_lora_rank)
    qk_nope_head_dim = property(lambda self: self.mla.qk_nope_head_dim)
    qk_rope_head_dim = property(lambda self: self.mla.qk_rope_head_dim)
    v_head_dim = property(lambda self: self.mla.v_head_dim)
    num_shared_experts = property(lambda self: self.moe.num_shared_experts)


def latent_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PackedMeta,
                     backend: str) -> torch.Tensor:
    """q/k [B, T, H, Dqk], v [B, T, H, Dv] -> [B, T, H, Dv] through the run's kernel; v zero-padded to Dqk for
    the kernels that take one head dim (flash, torch_varlen, context parallel), the padding cut from the output."""
    dv, dqk = v.shape[-1], q.shape[-1]
    if dv == dqk or (meta.context is None and backend not in PADDED_V):
        return attention(q, k, v, meta, backend)
    out = attention(q, k, F.pad(v, (0, dqk - dv)), meta, backend)
    return out[..., :dv]


class RopeKey(nn.Module):
    """The identity on the shared rotary key [B, T, rope]; a tensor-parallel plan hooks it so that the key's
    gradient, which each rank computes from its own heads only, is summed over the ranks (parallelize.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class LatentAttention(nn.Module):
    """Multi-head latent attention (see the module docstring); under tensor parallel each rank holds its heads of
    wq / wq_b, wkv_b and wo, and all of the low-rank projections and their norms."""

    def __init__(self, a: DeepSeekV3Args):
        super().__init__()
        m, h, heads = a.mla, a.hidden_size, a.num_heads
        self.mla, self.backend = m, a.attn_backend
        self.wq = self.wq_a = self.q_a_norm = self.wq_b = None
        if m.q_lora_rank is None:
            self.wq = Linear(h, heads * m.qk_head_dim, bias=False)
        else:
            self.wq_a = Linear(h, m.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS, a.use_fp32_norm)
            self.wq_b = Linear(m.q_lora_rank, heads * m.qk_head_dim, bias=False)
        self.wkv_a = Linear(h, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_a_norm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS, a.use_fp32_norm)
        self.wkv_b = Linear(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.wo = Linear(heads * m.v_head_dim, h, bias=False)
        self.rope_key = RopeKey()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: PackedMeta) -> torch.Tensor:
        B, T, _ = x.shape
        m = self.mla
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_a_norm(self.wq_a(x)))
        q_nope, q_rope = q.view(B, T, -1, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = self.wkv_b(self.kv_a_norm(latent)).view(B, T, -1, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        heads = kv.shape[2]  # this rank's heads under tensor parallel
        k_rope = apply_rotary(self.rope_key(k_rope).unsqueeze(2), cos, sin)
        q = torch.cat([q_nope, apply_rotary(q_rope, cos, sin)], dim=-1)
        if m.softmax_scale_factor != 1.0:
            q = q * m.softmax_scale_factor
        k = torch.cat([k_nope, k_rope.expand(B, T, heads, m.qk_rope_head_dim)], dim=-1)
        out = latent_attention(q, k, v, meta, self.backend)
        return self.wo(out.reshape(B, T, -1))


class LatentBlock(nn.Module):
    """A pre-norm block with latent attention (the dense block's names: attention_norm, attention, ffn_norm,
    feed_forward)."""

    def __init__(self, a: DeepSeekV3Args, feed_forward: nn.Module):
        super().__init__()
        self.attention_norm = RMSNorm(a.hidden_size, a.norm_eps, a.use_fp32_norm)
        self.attention = LatentAttention(a)
        self.ffn_norm = RMSNorm(a.hidden_size, a.norm_eps, a.use_fp32_norm)
        self.feed_forward = feed_forward

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: PackedMeta) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, meta)
        return x + self.feed_forward(self.ffn_norm(x))


class DeepSeekV3Transformer(MoETransformer):
    """The MoE transformer (embedding, norm, output, rotary, packing, context parallel: internlm/model.py) whose
    blocks have latent attention; block i's FFN: the dense SwiGLU or MoEFeedForward as `layer_mix` says."""

    def __init__(self, a: DeepSeekV3Args):
        m = a.mla
        if m.v_head_dim != m.qk_head_dim and a.attn_backend in PADDED_V:
            logger.info(f"latent attention: v_head_dim {m.v_head_dim} is padded with zeros to the q/k head dim "
                        f"{m.qk_head_dim} for the {a.attn_backend} kernel, which takes one head dim")
        super().__init__(a)

    def make_block(self, a: ModelArgs, layer: int) -> nn.Module:
        """Block `layer`: latent attention and the FFN MoETransformer.make_feed_forward gives (None: dense)."""
        ffn = self.make_feed_forward(a, layer)
        return LatentBlock(a, ffn if ffn is not None else FeedForward(a))
