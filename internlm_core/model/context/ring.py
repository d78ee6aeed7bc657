"""The ring mode: queries stay, key/value blocks travel around the ring of n ranks.

Forward, n steps: at step s this rank holds the k/v of ring position (p - s) mod n; it attends its queries to them
(blockwise core, keys planned by their global token indices and documents) and merges the partial output into its
running output by log-sum-exp, while the block moves on to the next rank (batch_isend_irecv, posted before the
step's compute and waited for after it). n - 1 shifts: the last block is not sent on.

Backward, n steps again: the k/v blocks travel as in the forward, and with each block its fp32 dk/dv accumulator:
each rank adds its queries' part of the block's gradients (with the final output and log-sum-exp, so every step's
part is exact) and passes the accumulator on with the block; after n shifts of the accumulators (the last one
without a block) each is back at the block's owner holding the whole gradient. dq stays local.
"""

from __future__ import annotations

import torch

from ...utils import collectives
from .blockwise import TokenSet, Plan, attend_backward, attend_forward, merge
from .counters import count_bytes
from .layout import RingPeers


def _shift(tensors: list[torch.Tensor], ring: RingPeers, tag: int = 0) -> tuple[list[torch.Tensor], list]:
    """Post the sends of `tensors` to the next rank and the receives of the previous rank's; (buffers, works).
    Shifts in flight together take different `tag`s (the k/v block 0, 1; its gradient accumulators 2, 3)."""
    recvs = [torch.empty_like(t) for t in tensors]
    works = collectives.batch_isend_irecv([(t, ring.next) for t in tensors], [(r, ring.prev) for r in recvs],
                                          group=ring.group, tag=tag)
    count_bytes(ring.tag, sum(t.numel() * t.element_size() for t in tensors))
    return recvs, works


def _wait(works: list) -> None:
    for w in works:
        w.wait()


class RingAttention(torch.autograd.Function):
    """q [B, Hkv, G, Tq, D] (this rank's queries), k/v [B, Hkv, Tk, D] (this rank's block) -> out like q."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingPeers, query: TokenSet,
                sources: list[TokenSet], plans: list[Plan]) -> torch.Tensor:
        kv = [k, v]
        out = lse = None
        for s in range(ring.size):
            nxt = _shift(kv, ring) if s < ring.size - 1 else None
            part = attend_forward(q, kv[0], kv[1], query, sources[s], plans[s])
            out, lse = part if out is None else merge(out, lse, *part)
            if nxt is not None:
                _wait(nxt[1])
                kv = nxt[0]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout = (ring, query, sources, plans)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring, query, sources, plans = ctx.layout
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        grads = [torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                 torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
        kv = [k, v]
        for s in range(ring.size):
            nxt = _shift(kv, ring) if s < ring.size - 1 else None
            attend_backward(q, kv[0], kv[1], lse, dout, delta, query, sources[s], plans[s], dq, *grads)
            if ring.size > 1:  # the accumulators move with their block; the n-th shift brings them home
                grads, works = _shift(grads, ring, tag=2)
                _wait(works)
            if nxt is not None:
                _wait(nxt[1])
                kv = nxt[0]
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingPeers, query: TokenSet,
                   sources: list[TokenSet], plans: list[Plan]) -> torch.Tensor:
    """Differentiable ring attention in the blockwise core's layout (see RingAttention)."""
    return RingAttention.apply(q, k, v, ring, query, sources, plans)
