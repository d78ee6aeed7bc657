"""The all-to-all mode (DeepSpeed Ulysses): exchange sequence shards for head shards, attend over whole rows.

Each of the a ranks holds [B, T_local, H, D] (its zigzag chunks of every row, all local heads). One all_to_all_single
turns that into [B, a * T_local, H / a, D]: every rank's chunks (in the group's rank order, so tokens stay in
zigzag order and the mask reads their global indices) for H / a of the heads; attention runs over them with the
blockwise core, and the reverse all-to-all brings the output back to [B, T_local, H, D]. The backward of each
all-to-all is the reverse all-to-all (`_SeqToHeads` / `_HeadsToSeq`).

Heads: the local query heads must divide by a (ValueError otherwise). Key/value heads that do not divide by a
are repeated first (each k/v head repeat_interleave'd a / gcd(Hkv, a) times: the least multiple of Hkv that a
divides, which the query heads' grouping still maps onto); the repeat's backward sums the copies' gradients.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from ...utils import collectives
from .blockwise import BlockwiseAttention, from_groups, to_groups
from .counters import count_bytes
from .layout import ContextMeta
from .varlen import varlen_context_attention


def _exchange(x: torch.Tensor, group: Optional[dist.ProcessGroup], tag: str) -> torch.Tensor:
    """all_to_all_single of x [a, ...] (part j to rank j), counted under `tag`."""
    out = torch.empty_like(x)
    collectives.all_to_all_single(out, x, group=group)
    count_bytes(tag, x.numel() // x.shape[0] * (x.shape[0] - 1) * x.element_size())
    return out


def _seq_to_heads(x: torch.Tensor, size: int, group: Optional[dist.ProcessGroup], tag: str) -> torch.Tensor:
    """[B, T, Hx, D] (this rank's tokens, all heads) -> [B, size * T, Hx / size, D] (every rank's tokens)."""
    B, T, H, D = x.shape
    parts = x.reshape(B, T, size, H // size, D).permute(2, 0, 1, 3, 4).contiguous()
    got = _exchange(parts, group, tag)  # [source rank, B, T, H / size, D]
    return got.permute(1, 0, 2, 3, 4).reshape(B, size * T, H // size, D)


def _heads_to_seq(y: torch.Tensor, size: int, group: Optional[dist.ProcessGroup], tag: str) -> torch.Tensor:
    """[B, size * T, h, D] (every rank's tokens, this rank's heads) -> [B, T, size * h, D] (the inverse)."""
    B, S, h, D = y.shape
    parts = y.reshape(B, size, S // size, h, D).transpose(0, 1).contiguous()
    got = _exchange(parts, group, tag)  # [head shard, B, T, h, D]
    return got.permute(1, 2, 0, 3, 4).reshape(B, S // size, size * h, D)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, size: int, group, tag: str) -> torch.Tensor:
        ctx.args = (size, group, tag)
        return _seq_to_heads(x, size, group, tag)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _heads_to_seq(grad, *ctx.args), None, None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, size: int, group, tag: str) -> torch.Tensor:
        ctx.args = (size, group, tag)
        return _heads_to_seq(y, size, group, tag)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _seq_to_heads(grad, *ctx.args), None, None, None


def seq_to_heads(x: torch.Tensor, size: int, group: Optional[dist.ProcessGroup], tag: str) -> torch.Tensor:
    """Differentiable [B, T, Hx, D] -> [B, size * T, Hx / size, D] over the all-to-all `group` of `size` ranks."""
    return x if size == 1 else _SeqToHeads.apply(x, size, group, tag)


def heads_to_seq(y: torch.Tensor, size: int, group: Optional[dist.ProcessGroup], tag: str) -> torch.Tensor:
    """Differentiable inverse of `seq_to_heads`."""
    return y if size == 1 else _HeadsToSeq.apply(y, size, group, tag)


def heads_for_all_to_all(k: torch.Tensor, v: torch.Tensor, heads: int, size: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Check that `heads` query heads divide over `size` ranks and repeat the k/v heads [B, T, Hkv, D] to the
    least multiple of Hkv that `size` divides (see the module's docstring)."""
    hkv = k.shape[2]
    if heads % size:
        raise ValueError(f"context parallel all-to-all over {size} ranks: the {heads} local attention heads must be "
                         f"a multiple of {size} (heads / tensor parallel size % all-to-all size == 0)")
    rep = size // math.gcd(hkv, size)
    if rep == 1:
        return k, v
    return k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ContextMeta,
                      kernel: Optional[str] = None) -> torch.Tensor:
    """The all_to_all mode: q [B, T/C, H, D], k/v [B, T/C, Hkv, D] -> [B, T/C, H, D]. kernel: a varlen kernel
    (varlen.KERNELS: one causal call over the whole rows), None: the blockwise core."""
    a, group, tag = meta.a2a_size, meta.a2a_group, meta.context.mode
    k, v = heads_for_all_to_all(k, v, q.shape[2], a)
    qh, kh, vh = (seq_to_heads(x, a, group, tag) for x in (q, k, v))
    if kernel is not None:
        return heads_to_seq(varlen_context_attention(qh, kh, vh, meta, kernel), a, group, tag)
    out = BlockwiseAttention.apply(*to_groups(qh, kh, vh), meta.query, meta.sources[0], meta.plans[0])
    return heads_to_seq(from_groups(out), a, group, tag)
