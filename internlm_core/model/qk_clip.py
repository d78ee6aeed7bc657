"""MuonClip's record (Kimi-K2, optimizer.muon_qk_clip): the largest pre-softmax logit of every attention head over a
step's forwards, and the W_q / W_k rows of each head, for optim/muon.py's clip.

A logit is q_h . k_g(h) / sqrt(head_dim) after rotary, over the pairs the head attends to (causal, inside its
document, inside a sliding window): the attention kernels (flash-attn among them) never materialize the scores, so
the record computes them once more, under no_grad, one block of 256 queries at a time (the attention's forward FLOPs
again, fp32). Heads are those of this rank's module (all of them outside tensor parallel)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from .attention import PackedMeta, document_ids_from_cu_seqlens

QUERY_BLOCK = 256


class LogitMax:
    """The running per-head maximum of one attention module's logits (None until a forward observed one)."""

    def __init__(self) -> None:
        self.value: Optional[torch.Tensor] = None

    @torch.no_grad()
    def observe(self, q: torch.Tensor, k: torch.Tensor, meta: PackedMeta) -> None:
        """q [B, T, H, D], k [B, T, Hkv, D] as the kernel receives them (rotary applied)."""
        if meta.context is not None:
            raise ValueError("optimizer.muon_qk_clip: not with context parallel (each rank holds chunks of rows)")
        B, T, H, D = q.shape
        k = k.repeat_interleave(H // k.shape[2], dim=2).float()
        docs = document_ids_from_cu_seqlens(meta.cu_seqlens, B, T).to(q.device) \
            if meta.cu_seqlens is not None and meta.mask is None else None
        pos = torch.arange(T, device=q.device)
        best = torch.full((H,), float("-inf"), device=q.device)
        for s in range(0, T, QUERY_BLOCK):
            rows = pos[s:s + QUERY_BLOCK]
            logits = torch.einsum("bqhd,bkhd->bhqk", q[:, s:s + QUERY_BLOCK].float(), k) / D ** 0.5
            if meta.mask is not None:
                allowed = meta.mask[:, :, s:s + QUERY_BLOCK, :]
            else:
                allowed = (pos[None, :] <= rows[:, None])[None, None]
                if docs is not None:
                    allowed = allowed & (docs[:, None, s:s + QUERY_BLOCK, None] == docs[:, None, None, :])
                if meta.window is not None:
                    allowed = allowed & (rows[:, None] - pos[None, :] < meta.window)[None, None]
            best = torch.maximum(best, logits.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3)))
        self.value = best if self.value is None else torch.maximum(self.value, best)


@dataclass
class QKHeads:
    """One attention module's record and projections: W_q rows [heads * head_dim], W_k rows [kv_heads * head_dim]."""

    record: LogitMax
    wq: nn.Linear
    wk: nn.Linear
    heads: int
    kv_heads: int
    head_dim: int


def install_logit_records(model: nn.Module) -> list[QKHeads]:
    """Give every attention module of `model` (one with wq, wk and head_dim) a LogitMax its forward fills; ValueError
    for q/k norms (they normalize away a scaling of W_q / W_k)."""
    out = []
    for m in model.modules():
        if not all(hasattr(m, a) for a in ("wq", "wk", "head_dim", "logit_max")):
            continue
        if getattr(m, "q_norm", None) is not None:
            raise ValueError("optimizer.muon_qk_clip: not with model.qk_norm (the q/k norms undo a scaling of W_q "
                             "and W_k)")
        m.logit_max = LogitMax()
        out.append(QKHeads(m.logit_max, m.wq, m.wk, m.wq.weight.shape[0] // m.head_dim,
                           m.wk.weight.shape[0] // m.head_dim, m.head_dim))
    return out
