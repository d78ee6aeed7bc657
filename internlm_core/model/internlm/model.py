"""The InternLM transformer, readable top to bottom (the module of the INTERNLM, INTERNLM2 and LLAMA families).

INTERNLM (v1): RMSNorm, rotary, SwiGLU FFN (width from mlp_ratio), bias on q/k/v/o.
INTERNLM2 / LLAMA: the same block with grouped-query attention and no bias.
Options other families turn on (ModelArgs): q/k norm (QWEN3), bias on q/k/v only (QWEN2), a sliding window
(MISTRAL), scaled rotary frequencies (LLAMA3), a head_dim other than hidden_size / heads (QWEN3).

Parameter names are stable across every parallel layout (`layers` is a ModuleDict keyed "0", "1", ...
so that pipeline stages keep the names of the layers they own); checkpoints and the state-dict adapters
rely on that.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..args import ModelArgs
from ..attention import PackedMeta, attention, build_packed_meta
from ..context import ContextGroup, local_positions
from ..init import init_parameters
from ..layers import Linear, RMSNorm, apply_rotary, rotary_tables
from ..mtp import MultiTokenPrediction, build_mtp, carry, embed_depths, uncarry


class Attention(nn.Module):
    logit_max = None  # optimizer.muon_qk_clip: a model/qk_clip.LogitMax that records each head's largest logit

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.head_dim, self.backend = a.head_dim, a.attn_backend
        self.wq = Linear(a.hidden_size, a.num_heads * a.head_dim, bias=a.qkv_bias)
        self.wk = Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.wv = Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.wo = Linear(a.num_heads * a.head_dim, a.hidden_size, bias=a.wo_bias)
        # Qwen3's q/k norm: one RMSNorm over head_dim shared by every head (the same weights on every tensor rank)
        self.q_norm = RMSNorm(a.head_dim, a.norm_eps, a.use_fp32_norm) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.norm_eps, a.use_fp32_norm) if a.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: PackedMeta) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallel each rank holds only its own heads
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.logit_max is not None and self.training:  # the step's forwards, not validation's
            self.logit_max.observe(q, k, meta)
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
    def __init__(self, a: ModelArgs, feed_forward: Optional[nn.Module] = None):
        super().__init__()
        self.attention_norm = RMSNorm(a.hidden_size, a.norm_eps, a.use_fp32_norm)
        self.attention = Attention(a)
        self.ffn_norm = RMSNorm(a.hidden_size, a.norm_eps, a.use_fp32_norm)
        self.feed_forward = feed_forward if feed_forward is not None else FeedForward(a)  # MoE families pass theirs
        self.post_norm = a.apply_post_layer_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: PackedMeta) -> torch.Tensor:
        if self.post_norm:
            x = self.attention_norm(x + self.attention(x, cos, sin, meta))
            return self.ffn_norm(x + self.feed_forward(x))
        x = x + self.attention(self.attention_norm(x), cos, sin, meta)
        return x + self.feed_forward(self.ffn_norm(x))


class Rotary(nn.Module):
    """The rotary cos/sin tables [max_seqlen, head_dim] (not saved: rebuilt from the shape)."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.shape = (a.head_dim, a.max_seqlen, a.rope_base, a.rope_scaling)
        cos, sin = rotary_tables(*self.shape)  # on the meta device under a meta build: no values yet
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def reset(self, device: torch.device) -> None:
        if device.type != "meta":
            cos, sin = rotary_tables(*self.shape)
            self.cos, self.sin = cos.to(device), sin.to(device)


class Transformer(nn.Module):
    """Embedding → blocks → norm → output. Any of them may be None on a pipeline stage that lacks it."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.tok_embeddings: Optional[nn.Embedding] = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleDict({str(i): self.make_block(a, i) for i in range(a.num_layers)})
        self.norm: Optional[RMSNorm] = RMSNorm(a.hidden_size, a.norm_eps, a.use_fp32_norm)
        self.output: Optional[nn.Linear] = Linear(a.hidden_size, a.vocab_size, bias=False)
        if a.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.rope = Rotary(a)  # a module of its own: pipeline chunks share it (and its materialized tables)
        # model.mtp (model/mtp.py): depth k's block is the family's block number num_layers + k; None when off
        self.mtp: Optional[MultiTokenPrediction] = build_mtp(a, lambda k: self.make_block(a, a.num_layers + k))
        # context parallel (model/context, set by set_context_parallel): forward then takes the rank's zigzag
        # chunk of every row (ids, position_ids, document_ids [B, T/C]); None: whole rows
        self.context: Optional[ContextGroup] = None
        if self.rope.cos.device.type != "meta":  # built directly on a device: usable at once
            self.init_weights()

    def make_block(self, a: ModelArgs, layer: int) -> nn.Module:
        """Block `layer`: the TransformerBlock with `make_feed_forward`'s FFN (a family with another attention,
        DeepSeek-V3's latent attention, returns its own block with the same names and call)."""
        return TransformerBlock(a, self.make_feed_forward(a, layer))

    def make_feed_forward(self, a: ModelArgs, layer: int) -> Optional[nn.Module]:
        """The FFN of block `layer`; None: the dense SwiGLU (a mixture-of-experts family returns its MoE layer)."""
        return None

    def init_weights(self, seed: int = 0, buffer_device: Optional[torch.device] = None) -> None:
        """N(0, init_std) matrices, zero biases, unit norms, each from its own generator (model/init.py: the same
        values in every layout); rebuilds the rotary tables on `buffer_device` (after a meta build)."""
        init_parameters(self, seed, self._fill)
        self.rope.reset(buffer_device or self.rope.cos.device)

    def _fill(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        if name.endswith("norm.weight"):  # attention_norm, ffn_norm, norm: RMSNorm scales
            full.fill_(1.0)
        elif name.endswith(".bias"):
            full.zero_()
        else:
            full.normal_(0.0, self.args.init_std, generator=generator)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None, document_ids: Optional[torch.Tensor] = None,
                mtp_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids [B, T] → logits [B, T, V]; on a later pipeline stage the input is the previous stage's
        hidden states (under sequence parallel [B, T / tensor, hidden]) and position_ids are required.

        position_ids: [B, T] position of each token in its document (default 0..T-1 per row).
        cu_seqlens: int32 document offsets over the flattened B*T tokens (default: one document per row),
        or document_ids: [B, T] the document of each token (see attention.py).
        Under context parallel (`self.context`) each [B, T] input is the rank's zigzag chunk [B, T/C] of the rows
        (document_ids, not cu_seqlens) and the logits are the chunk's.
        mtp_ids [B, T, D]: model.mtp's token ids of each depth (mtp.mtp_targets); the depths' logits are left in
        `self.mtp.pending`, and a pipeline stage hands the depths' embeddings on with its hidden states (mtp.py).
        """
        if position_ids is None:
            if self.tok_embeddings is None:
                raise ValueError("position_ids are required when the input is hidden states (a later pipeline stage)")
            B, T = input_ids.shape
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T) if self.context is None else \
                local_positions(self.context, T, input_ids.device).expand(B, T)
        B, T = position_ids.shape
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(input_ids)
            s = self.args.embed_grad_scale
            if s != 1.0:  # InternLM's embed_grad_scale: same forward, scaled gradient into the embedding
                h = s * h + (1.0 - s) * h.detach()
        else:
            h = input_ids
        h, carried = uncarry(h, self.args.hidden_size)  # a later stage: the depths' embeddings the first one sent
        if mtp_ids is not None and self.tok_embeddings is not None and self.args.mtp_depth:
            carried = embed_depths(self.tok_embeddings, mtp_ids)
        cos = self.rope.cos[position_ids].unsqueeze(2)
        sin = self.rope.sin[position_ids].unsqueeze(2)
        window, some = self.args.sliding_window, self.args.window_layers
        meta = build_packed_meta(cu_seqlens, B, T, self.args.attn_backend, h.device, document_ids,
                                 window=window if some is None else None, context=self.context)
        windowed = meta if some is None or not window else build_packed_meta(
            cu_seqlens, B, T, self.args.attn_backend, h.device, document_ids, window=window, context=self.context)
        for i, layer in self.layers.items():  # window_layers: the window on those layers only (Qwen's)
            h = layer(h, cos, sin, windowed if some is None or int(i) in some else meta)
        if self.mtp is not None and carried is not None:  # the depths see the main model's h before its final norm
            self.mtp.pending = self.mtp(h, carried, self.output, lambda block, x: block(x, cos, sin, windowed))
        elif self.output is None:  # a stage before the last
            h = carry(h, carried)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h
