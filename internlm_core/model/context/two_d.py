"""The 2d mode (InternEvo's sequence_2D: head_size x context_size): all-to-all inside groups of `inner` ranks,
ring across the C / inner groups.

Context rank r = o * inner + i (layout.py). Each rank first trades sequence for heads with the other ranks of its
outer group o (ulysses.seq_to_heads over the inner group): it then holds the tokens of its whole outer group for
H / inner of the heads. A ring over the outer groups, between the ranks of the same inner position i (which hold
the same heads), completes the keys (ring.RingAttention, its peers in ContextMeta.ring); the reverse all-to-all
brings the output home. The all-to-all moves (inner - 1) / inner of the rank's q, k, v and output, the ring
blocks of Hk / inner heads of inner * T_local tokens: the same bytes per ring step as the plain ring, over
n = C / inner steps instead of C.
"""

from __future__ import annotations

from typing import Optional

import torch

from .blockwise import from_groups, to_groups
from .layout import ContextMeta
from .ring import ring_attention
from .ulysses import heads_for_all_to_all, heads_to_seq, seq_to_heads
from .varlen import varlen_context_attention


def two_d_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ContextMeta,
                    kernel: Optional[str] = None) -> torch.Tensor:
    """The 2d mode (and the ring mode, whose all-to-all size is 1): q [B, T/C, H, D], k/v [B, T/C, Hkv, D] ->
    [B, T/C, H, D]. kernel: a varlen kernel (varlen.KERNELS: one or two calls per ring step), None: the blockwise
    core."""
    a, group, tag = meta.a2a_size, meta.a2a_group, meta.context.mode
    k, v = heads_for_all_to_all(k, v, q.shape[2], a)
    qh, kh, vh = (seq_to_heads(x, a, group, tag) for x in (q, k, v))
    if meta.ring is None:
        raise ValueError("2d context parallel without a ring (inner == size): use mode 'all_to_all'")
    if kernel is not None:
        return heads_to_seq(varlen_context_attention(qh, kh, vh, meta, kernel), a, group, tag)
    out = ring_attention(*to_groups(qh, kh, vh), meta.ring, meta.query, meta.sources, meta.plans)
    return heads_to_seq(from_groups(out), a, group, tag)
