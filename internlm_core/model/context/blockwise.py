"""Blockwise attention with log-sum-exp: the core every context-parallel mode computes with.

Queries and keys carry their global token index within the row and their document id: a query attends to a key
iff both lie in the same document and the key's index is not greater (and, under a sliding window of w keys,
greater than the query's index - w). Tokens may come in any order (a rank's zigzag chunks, an all-to-all's
gathered chunks): the mask is built from the indices, never from storage positions.

Work goes in blocks of query rows against ranges of key rows. `plan_blocks` decides once per forward, on the host,
which key blocks each query block needs (a block wholly in the future, beyond the window, or in other documents
is never computed), so no [T, T] score matrix is ever made; a query block's scores against one key range are the
largest temporary. Forward returns the output and the log-sum-exp of every query's scores (fp32 softmax
statistics), so partial results over different keys merge exactly (`merge`, the ring's step); backward is written
by hand from q, k, v, out, lse, dout (flash attention's):

    P = exp(S - lse)   dV = P^T dO   dP = dO V^T   D = rowsum(dO * O)   dS = P (dP - D)
    dQ = dS K * scale  dK = dS^T Q * scale

and keeps nothing of size T * T for it (q, k, v, the output and lse only). Grouped-query attention uses the
[B, Hkv, G, T, D] view of the queries (G = H / Hkv) against [B, Hkv, T, D] keys: k/v are never repeated.
Plain torch ops: fp32 and bf16 inputs, on CPU and CUDA: the reference, and the CPU path. On GPUs with the flash or
torch_varlen kernels the modes run on torch's FA2 varlen kernels instead (varlen.py, which also writes those
kernels' contract as one CPU implementation on this core).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

# rows of a query block and of a key block (the unit of skipping)
BLOCK = 256
# keys of one range at most: a query block's fp32 scores and their temporaries stay [rows, RANGE_KEYS] per head
# whatever the sequence length
RANGE_KEYS = 4 * BLOCK
# on a GPU each (query block, key range) pair costs ~10 kernel launches: larger tiles keep the launches few (fp32
# scores of 1024 x 4096 per head, 16 MiB; 0.5 GiB for 32 local heads)
CUDA_BLOCK, CUDA_RANGE_KEYS = 1024, 4096


def tile_sizes(device: torch.device) -> tuple[int, int]:
    """(block, range_keys) for `plan_blocks` on `device`."""
    return (CUDA_BLOCK, CUDA_RANGE_KEYS) if device.type == "cuda" else (BLOCK, RANGE_KEYS)


@dataclass
class TokenSet:
    """Tokens of one side of the attention: index int64 [S] (position in the row), doc int64 [B, S] (document
    ids) on the compute device, and their host copies for planning."""

    index: torch.Tensor
    doc: torch.Tensor
    index_host: torch.Tensor
    doc_host: torch.Tensor


@dataclass
class Plan:
    """blocks: (query start, query end, [(key start, key end, full), ...]) with only the key ranges the queries
    need; `full`: every query of the block sees every key of the range (no mask to build or apply);
    window: sliding-window keys per query (None: none)."""

    blocks: list[tuple[int, int, list[tuple[int, int, bool]]]] = field(default_factory=list)
    window: Optional[int] = None


def token_set(index: torch.Tensor, doc: torch.Tensor) -> TokenSet:
    """A TokenSet from index [S] and doc [B, S] on the compute device (host copies made here)."""
    return TokenSet(index, doc, index.cpu(), doc.cpu())


def _blocks(index: torch.Tensor, block: int) -> list[tuple[int, int]]:
    """[start, end) blocks of at most `block` rows that never straddle a jump in the token index (so each block
    covers one contiguous run of positions and its bounds are tight)."""
    S = index.numel()
    jumps = (torch.nonzero(index[1:] != index[:-1] + 1).flatten() + 1).tolist()
    out = []
    for s, e in zip([0] + jumps, jumps + [S]):
        out += [(b, min(b + block, e)) for b in range(s, e, block)]
    return out


def _stats(t: TokenSet, blocks: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
    """Per block: index min and max [n] (a block is one run of consecutive positions), document min and max per
    row [B, n] (host)."""
    starts = torch.tensor([s for s, _ in blocks])
    ends = torch.tensor([e for _, e in blocks])
    block_of = torch.repeat_interleave(torch.arange(len(blocks)), ends - starts).expand_as(t.doc_host)
    B, n = t.doc_host.shape[0], len(blocks)
    lo = t.doc_host.new_zeros((B, n)).scatter_reduce_(1, block_of, t.doc_host, "amin", include_self=False)
    hi = t.doc_host.new_zeros((B, n)).scatter_reduce_(1, block_of, t.doc_host, "amax", include_self=False)
    return t.index_host[starts], t.index_host[ends - 1], lo, hi


def plan_blocks(q: TokenSet, k: TokenSet, window: Optional[int] = None, block: int = BLOCK,
                range_keys: int = RANGE_KEYS) -> Plan:
    """Which key blocks each query block needs: a pair is skipped when every key is in the future of every query,
    beyond the window, or when no row has a document in both (document intervals disjoint); it is full when every
    key is in the past of every query, within the window and, in every row, in the one document of all of them.
    Adjacent needed key blocks, both full or both not, are merged into ranges of at most `range_keys` keys."""
    qb, kb = _blocks(q.index_host, block), _blocks(k.index_host, block)
    if not qb or not kb:
        return Plan([], window)
    q_lo, q_hi, qd_lo, qd_hi = _stats(q, qb)
    k_lo, k_hi, kd_lo, kd_hi = _stats(k, kb)
    need = k_lo[None, :] <= q_hi[:, None]
    if window is not None:
        need &= k_hi[None, :] > q_lo[:, None] - window
    need &= ((kd_lo[:, None, :] <= qd_hi[:, :, None]) & (qd_lo[:, :, None] <= kd_hi[:, None, :])).any(0)
    full = need & (k_hi[None, :] <= q_lo[:, None])
    if window is not None:
        full &= k_lo[None, :] > q_hi[:, None] - window
    one_doc = (qd_lo == qd_hi)[:, :, None] & (kd_lo == kd_hi)[:, None, :] & (qd_lo[:, :, None] == kd_lo[:, None, :])
    full &= one_doc.all(0)
    blocks = []
    for i, (s, e) in enumerate(qb):
        ranges: list[tuple[int, int, bool]] = []
        for j in torch.nonzero(need[i]).flatten().tolist():
            (ks, ke), f = kb[j], bool(full[i, j])
            if ranges and ranges[-1][1] == ks and ranges[-1][2] == f and ke - ranges[-1][0] <= range_keys:
                ranges[-1] = (ranges[-1][0], ke, f)
            else:
                ranges.append((ks, ke, f))
        blocks.append((s, e, ranges))
    return Plan(blocks, window)


def _allowed(q: TokenSet, k: TokenSet, qs: int, qe: int, ks: int, ke: int, full: bool, window: Optional[int]
             ) -> Optional[torch.Tensor]:
    """bool [B, 1, 1, rows, keys]: True where the query attends to the key; None for a full range."""
    if full:
        return None
    qi, ki = q.index[qs:qe, None], k.index[None, ks:ke]
    ok = ki <= qi
    if window is not None:
        ok &= ki > qi - window
    same = q.doc[:, qs:qe, None] == k.doc[:, None, ks:ke]
    return (same & ok)[:, None, None]


def _scores(q: torch.Tensor, k: torch.Tensor, allowed: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """fp32 scores [B, Hkv, G, rows, keys] of q [B, Hkv, G, rows, D] against k [B, Hkv, keys, D], -inf where
    masked (the matmul in the input dtype, as the other kernels)."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)).float() * scale
    return s if allowed is None else s.masked_fill_(~allowed, float("-inf"))


def merge(out: torch.Tensor, lse: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint keys (fp32 out [..., T, D], lse [..., T]); a query without
    keys has lse -inf and weighs nothing."""
    new = torch.logaddexp(lse, lse2)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    w1, w2 = torch.exp(lse - safe).unsqueeze(-1), torch.exp(lse2 - safe).unsqueeze(-1)
    return out * w1 + out2 * w2, new


def _range_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: Optional[torch.Tensor], scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """out fp32 [B, Hkv, G, rows, D] and lse [B, Hkv, G, rows] of one query block against one key range."""
    s = _scores(q, k, allowed, scale)
    lse = torch.logsumexp(s, -1, keepdim=True)  # one fused pass (max, exp, sum)
    # a row without keys here has lse -inf: shifting by 0 instead gives it probabilities exp(-inf) = 0, not nan
    shift = lse if allowed is None else torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = s.sub_(shift).exp_().to(v.dtype)  # normalized probabilities, in place of the scores
    return torch.matmul(p, v.unsqueeze(2)).float(), lse.squeeze(-1)


def attend_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qt: TokenSet, kt: TokenSet, plan: Plan
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hkv, G, Tq, D], k/v [B, Hkv, Tk, D] -> out fp32 [B, Hkv, G, Tq, D] and lse fp32 [B, Hkv, G, Tq] (-inf,
    and out 0, for a query with no key here)."""
    scale = q.shape[-1] ** -0.5
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    for qs, qe, ranges in plan.blocks:
        acc = None
        for ks, ke, full in ranges:
            allowed = _allowed(qt, kt, qs, qe, ks, ke, full, plan.window)
            part = _range_forward(q[..., qs:qe, :], k[:, :, ks:ke], v[:, :, ks:ke], allowed, scale)
            acc = part if acc is None else merge(*acc, *part)
        if acc is not None:
            out[..., qs:qe, :], lse[..., qs:qe] = acc
    return out, lse


def attend_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                    delta: torch.Tensor, qt: TokenSet, kt: TokenSet, plan: Plan, dq: torch.Tensor, dk: torch.Tensor,
                    dv: torch.Tensor) -> None:
    """Add this key set's part of the gradients into the fp32 accumulators dq [B, Hkv, G, Tq, D] and dk/dv
    [B, Hkv, Tk, D]. lse: the final log-sum-exp of every query (over all keys of all steps); delta =
    rowsum(dout * out) with the final output."""
    scale = q.shape[-1] ** -0.5
    dt = q.dtype
    B, hkv, G, _, D = q.shape
    for qs, qe, ranges in plan.blocks:
        qb, dob = q[..., qs:qe, :], dout[..., qs:qe, :]
        # the G query heads of one k/v head as G * rows rows: dK, dV in one matmul each, no per-head copies to sum
        qf, dof = qb.reshape(B, hkv, G * (qe - qs), D), dob.reshape(B, hkv, G * (qe - qs), D)
        lb, db = lse[..., qs:qe, None], delta[..., qs:qe, None]
        for ks, ke, full in ranges:
            kr, vr = k[:, :, ks:ke], v[:, :, ks:ke]
            # in place wherever a temporary of [rows, keys] per head can be reused (the largest ones here)
            p = _scores(qb, kr, _allowed(qt, kt, qs, qe, ks, ke, full, plan.window), scale).sub_(lb).exp_()
            dv[:, :, ks:ke] += torch.matmul(p.to(dt).flatten(2, 3).transpose(-1, -2), dof).float()
            ds = torch.matmul(dob, vr.unsqueeze(2).transpose(-1, -2)).float().sub_(db).mul_(p).to(dt)
            del p
            dq[..., qs:qe, :] += torch.matmul(ds, kr.unsqueeze(2)).float() * scale
            dk[:, :, ks:ke] += torch.matmul(ds.flatten(2, 3).transpose(-1, -2), qf).float() * scale


class BlockwiseAttention(torch.autograd.Function):
    """Blockwise attention of one rank's queries against keys it holds (no communication)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qt: TokenSet, kt: TokenSet,
                plan: Plan) -> torch.Tensor:
        out, lse = attend_forward(q, k, v, qt, kt, plan)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout = (qt, kt, plan)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        attend_backward(q, k, v, lse, dout, delta, *ctx.layout, dq, dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def one_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v in one dtype. Equal dtypes pass untouched; mixed ones go to the dtype the kernels compute in:
    autocast's where it is on for their device (as CUDA's SDPA and flash-attn run under it), else v's (v leaves
    its linear layer with no norm or rotary in between: it carries the compute dtype). Why: q/k that a norm handed
    on in fp32 next to a bf16 v (CUDA autocast's rms_norm did, before norms returned their input's dtype) would
    meet v in the hand-written backward, which multiplies them outside autocast (`attend_backward`: dO V^T). The
    cast is differentiable: their gradients come back in q's and k's own dtypes."""
    if q.dtype == k.dtype == v.dtype:
        return q, k, v
    device = v.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else v.dtype
    return q.to(dtype), k.to(dtype), v.to(dtype)


def to_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, T, H, D] / [B, T, Hkv, D] -> q [B, Hkv, H / Hkv, T, D], k/v [B, Hkv, T, D], contiguous."""
    B, T, H, D = q.shape
    hkv = k.shape[2]
    if H % hkv:
        raise ValueError(f"attention: {H} query heads are not a multiple of {hkv} key/value heads")
    q5 = q.transpose(1, 2).reshape(B, hkv, H // hkv, T, D).contiguous()
    return q5, k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


def from_groups(out: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, G, T, D] -> [B, T, Hkv * G, D]."""
    B, hkv, G, T, D = out.shape
    return out.reshape(B, hkv * G, T, D).transpose(1, 2)


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                        doc: torch.Tensor, window: Optional[int] = None, block: int = BLOCK) -> torch.Tensor:
    """Attention of tokens at row positions `index` [T] with document ids `doc` [B, T] among themselves:
    q [B, T, H, D], k/v [B, T, Hkv, D] -> [B, T, H, D]."""
    q, k, v = one_dtype(q, k, v)
    tokens = token_set(index.to(q.device), doc.to(q.device))
    plan = plan_blocks(tokens, tokens, window, block)
    return from_groups(BlockwiseAttention.apply(*to_groups(q, k, v), tokens, tokens, plan))
