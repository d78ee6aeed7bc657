"""Context-parallel attention on varlen kernels (flash attention with log-sum-exp), and their contract on the CPU.

The GPU kernels (torch's `aten._flash_attention_forward/backward`, the FA2 kernels inside torch that
`torch.nn.attention.varlen.varlen_attn` calls) take packed segments and return the log-sum-exp:

    forward(q [Tq, H, D], k/v [Tk, Hkv, D], cu_q, cu_k int32 [n+1], max_q, max_k, scale, causal, window)
        -> out [Tq, H, D] (q's dtype), lse fp32 [H, Tq]
    backward(dout, q, k, v, out, lse, same layout) -> dq, dk, dv (the inputs' dtypes)

Segment i's queries q[cu_q[i]:cu_q[i+1]] see only segment i's keys. Alignment is bottom-right: query j of a
segment of Lq queries and Lk keys stands at key position j + Lk - Lq; `causal` keeps keys at or before it; window
(left, right): keys from position - left to position + right (-1: unbounded; causal means right 0). Grouped-query
attention: H a multiple of Hkv. A query that sees no key is never passed (the plans below never make one).
`contract_forward` / `contract_backward` are that contract on any device, computed with the blockwise core
(blockwise.attend_forward / attend_backward); tools/gpu_check.sh compares the real kernel with it.

The plumbing (`plan_calls`): the queries and keys one step pairs are cut into pieces, runs of consecutive row
positions at every boundary of either side, so two pieces are equal or disjoint. Equal pieces pair causally (one
segment per document; the all-to-all mode's whole row is one such piece, in natural token order: one call); a key
piece wholly before a query piece is fully visible: only the document open at the query piece's start reaches
back, one segment per row (its queries' prefix, the keys of that document before it). Under a sliding window of
w keys a fully visible pair is trimmed to the queries and keys the window joins, which then align bottom-right
with window (left, -1). Calls that share queries merge by log-sum-exp (blockwise.merge); backward runs the
kernel's backward on each call with the final output and log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...utils.transfer import to_device
from .blockwise import TokenSet, attend_backward, attend_forward, from_groups, merge, plan_blocks, to_groups
from .layout import ContextMeta, RingPeers
from .ring import _shift, _wait

KERNELS = ("contract", "aten_flash")
# the contract's stand-in for an unbounded window side (row positions stay far below it)
_FAR = 1 << 40
Window = tuple[int, int]


@dataclass
class VarlenCall:
    """One kernel call: q_idx / k_idx int64 (flat indices into the step's [B * S] queries / keys, on the device),
    cu_q / cu_k int32 [n+1] on the device, max_q / max_k, causal, window (left, right)."""

    q_idx: torch.Tensor
    k_idx: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    causal: bool
    window: Window


def _contract_tokens(cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool, window: Window
                     ) -> tuple[TokenSet, TokenSet, Optional[int]]:
    """The contract's mask as blockwise token sets (doc = segment, index = aligned position) and window."""
    cq, ck = cu_q.cpu().long(), cu_k.cpu().long()
    lq, lk = cq.diff(), ck.diff()
    n = len(lq)
    seg_q, seg_k = torch.repeat_interleave(torch.arange(n), lq), torch.repeat_interleave(torch.arange(n), lk)
    pos_k = torch.arange(int(ck[-1])) - ck[seg_k]
    pos_q = torch.arange(int(cq[-1])) - cq[seg_q] + (lk - lq)[seg_q]
    left, right = window
    right = 0 if causal else right
    if right == 0:  # keys from position - left to position
        w = left + 1 if left >= 0 else None
    elif right == -1:  # keys from position - left on: the query stands far ahead, the window reaches back to it
        pos_q = pos_q + _FAR - 1 - (left if left >= 0 else _FAR // 2)
        w = _FAR
    else:
        raise ValueError(f"varlen contract: window right side {right} (only 0 or -1, unbounded, are planned)")
    to = lambda idx, seg: TokenSet(idx, seg[None], idx, seg[None])  # noqa: E731
    return to(pos_q, seg_q), to(pos_k, seg_k), w


def _device_tokens(t: TokenSet, device: torch.device) -> TokenSet:
    return TokenSet(t.index.to(device), t.doc.to(device), t.index_host, t.doc_host)


def _contract_layout(q: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool, window: Window):
    qt, kt, w = _contract_tokens(cu_q, cu_k, causal, window)
    plan = plan_blocks(qt, kt, w)
    return _device_tokens(qt, q.device), _device_tokens(kt, q.device), plan


def _scaled(q: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
    """q with the blockwise core's fixed D^-0.5 turned into `scale`."""
    return q if scale is None else q * (scale / q.shape[-1] ** -0.5)


def contract_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     max_q: int, max_k: int, scale: Optional[float] = None, causal: bool = False,
                     window: Window = (-1, -1)) -> tuple[torch.Tensor, torch.Tensor]:
    """The varlen kernels' forward (module docstring) on any device: out [Tq, H, D] in q's dtype, lse fp32
    [H, Tq]. max_q / max_k are the kernels' arguments (unused here)."""
    qt, kt, plan = _contract_layout(q, cu_q, cu_k, causal, window)
    q5, k4, v4 = to_groups(_scaled(q, scale)[None], k[None], v[None])
    out, lse = attend_forward(q5, k4, v4, qt, kt, plan)
    return from_groups(out)[0].to(q.dtype), lse.reshape(q.shape[1], q.shape[0])


def contract_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
                      scale: Optional[float] = None, causal: bool = False, window: Window = (-1, -1)
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The varlen kernels' backward with any (final) out and lse: dq, dk, dv in the inputs' dtypes."""
    qt, kt, plan = _contract_layout(q, cu_q, cu_k, causal, window)
    q5, k4, v4 = to_groups(_scaled(q, scale)[None], k[None], v[None])
    do5 = to_groups(dout[None], k[None], v[None])[0]
    hkv, G = q5.shape[1], q5.shape[2]
    delta = (dout.float() * out.float()).sum(-1).transpose(0, 1).reshape(1, hkv, G, -1)
    dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (q5, k4, v4))
    attend_backward(q5, k4, v4, lse.reshape(1, hkv, G, -1), do5, delta, qt, kt, plan, dq, dk, dv)
    dq = from_groups(dq)[0]
    if scale is not None:
        dq = dq * (scale / q.shape[-1] ** -0.5)
    return dq.to(q.dtype), dk[0].transpose(0, 1).to(k.dtype), dv[0].transpose(0, 1).to(v.dtype)


_RNG = {}


def _aten_args(call: VarlenCall) -> dict:
    left, right = call.window
    return dict(window_size_left=left, window_size_right=0 if call.causal else right)


def kernel_forward(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: VarlenCall
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One call's (out [n, H, D], lse fp32 [H, n]) on `kernel` ("contract" or "aten_flash": torch's FA2 kernels,
    CUDA, 16-bit inputs)."""
    if kernel == "contract":
        return contract_forward(q, k, v, call.cu_q, call.cu_k, call.max_q, call.max_k, None, call.causal,
                                call.window)
    out, lse = torch.ops.aten._flash_attention_forward(q, k, v, call.cu_q, call.cu_k, call.max_q, call.max_k, 0.0,
                                                       call.causal, False, **_aten_args(call))[:2]
    return out, lse


def kernel_backward(kernel: str, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, call: VarlenCall
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One call's dq, dk, dv from the final out and lse (rows of this call's queries)."""
    if kernel == "contract":
        return contract_backward(dout, q, k, v, out, lse, call.cu_q, call.cu_k, call.max_q, call.max_k, None,
                                 call.causal, call.window)
    device = q.device
    if device not in _RNG:  # dropout 0: the kernels read no random state (torch's varlen_attn passes zeros too)
        _RNG[device] = (torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(0, device=device))
    return torch.ops.aten._flash_attention_backward(dout, q, k, v, out, lse, call.cu_q, call.cu_k, call.max_q,
                                                    call.max_k, 0.0, call.causal, *_RNG[device], **_aten_args(call))


def _runs(positions: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive values among sorted `positions`."""
    p = positions.sort().values
    cuts = (torch.nonzero(p[1:] != p[:-1] + 1).flatten() + 1).tolist()
    return [(int(p[s]), int(p[e - 1]) + 1) for s, e in zip([0] + cuts, cuts + [len(p)])]


def _pieces(index: torch.Tensor, bounds: list[int]) -> list[tuple[int, int]]:
    """The [start, end) pieces between consecutive `bounds` that `index`'s positions cover."""
    covered = torch.zeros(bounds[-1], dtype=torch.bool)
    covered[index] = True
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if bool(covered[a])]


class _Segments:
    """Segments of one call being collected: storage indices of queries and keys, and the lengths."""

    def __init__(self, causal: bool, window: Window) -> None:
        self.causal, self.window = causal, window
        self.q: list[torch.Tensor] = []
        self.k: list[torch.Tensor] = []

    def add(self, q: torch.Tensor, k: torch.Tensor) -> None:
        if len(q) and len(k):
            self.q.append(q)
            self.k.append(k)

    def call(self, device: torch.device) -> VarlenCall:
        """The call, its index tensors copied to `device` without making the host wait (pinned, non-blocking)."""
        cu = [torch.tensor([0] + [len(x) for x in side]).cumsum(0).to(torch.int32) for side in (self.q, self.k)]
        q_idx, k_idx, cu_q, cu_k = (to_device(t, device) for t in (torch.cat(self.q), torch.cat(self.k), *cu))
        return VarlenCall(q_idx, k_idx, cu_q, cu_k, max(len(x) for x in self.q), max(len(x) for x in self.k),
                          self.causal, self.window)


def _doc_runs(doc: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) runs of equal ids in one row's doc [n]."""
    cuts = (torch.nonzero(doc[1:] != doc[:-1]).flatten() + 1).tolist()
    return list(zip([0] + cuts, cuts + [len(doc)]))


def plan_calls(query: TokenSet, source: TokenSet, window: Optional[int], device: torch.device) -> list[VarlenCall]:
    """The kernel calls of one step: `query`'s tokens against `source`'s keys (module docstring), on the host."""
    qi, ki = query.index_host, source.index_host
    size = int(max(qi.max(), ki.max())) + 1
    bounds = sorted({b for a, e in _runs(qi) + _runs(ki) for b in (a, e)} | {0, size})
    where_q = torch.full((size,), -1, dtype=torch.int64).index_put_((qi,), torch.arange(len(qi)))
    where_k = torch.full((size,), -1, dtype=torch.int64).index_put_((ki,), torch.arange(len(ki)))
    qp, kp = _pieces(qi, bounds), _pieces(ki, bounds)
    left = window - 1 if window is not None else -1
    calls: dict = {"diag": _Segments(True, (left, 0))}
    B, Sq, Sk = query.doc_host.shape[0], len(qi), len(ki)
    for r in range(B):
        qdoc = torch.zeros(size, dtype=torch.int64).index_put_((qi,), query.doc_host[r])
        kdoc = torch.zeros(size, dtype=torch.int64).index_put_((ki,), source.doc_host[r])
        for a, b in qp:
            if (a, b) in kp:
                for s, e in _doc_runs(qdoc[a:b]):
                    calls["diag"].add(r * Sq + where_q[a + s:a + e], r * Sk + where_k[a + s:a + e])
            before = [(c, d) for c, d in kp if d <= a]
            if before:
                _full_pairs(calls, r, (a, b), before, qdoc, kdoc, where_q, where_k, (Sq, Sk), window)
    return [seg.call(device) for seg in calls.values() if seg.q]


def _full_pairs(calls: dict, r: int, piece: tuple[int, int], before: list[tuple[int, int]], qdoc: torch.Tensor,
                kdoc: torch.Tensor, where_q: torch.Tensor, where_k: torch.Tensor, sizes: tuple[int, int],
                window: Optional[int]) -> None:
    """Segments of row r's query piece against the key pieces wholly before it: only the document open at the
    piece's start reaches back (documents are runs of equal ids)."""
    a, b = piece
    Sq, Sk = sizes
    d0 = qdoc[a]
    lq = int((qdoc[a:b] != d0).long().argmax()) if bool((qdoc[a:b] != d0).any()) else b - a
    if window is None:  # every key of the document before the piece, in one segment
        keys = torch.cat([where_k[c:d][kdoc[c:d] == d0] for c, d in before])
        calls.setdefault("full", _Segments(False, (-1, -1))).add(r * Sq + where_q[a:a + lq], r * Sk + keys)
        return
    for c, d in before:  # the window joins the queries' prefix and the keys' suffix of the document
        m = window - 1 - (a - d)  # query j sees key j' of the suffix of Lk keys iff j' >= j + Lk - m
        lk = int((kdoc[c:d] == d0).sum())
        if m <= 0 or lk == 0:
            continue
        lq2, lk2 = min(lq, m), min(lk, m)
        seg = calls.setdefault(("full", m - lq2, c), _Segments(False, (m - lq2, -1)))
        seg.add(r * Sq + where_q[a:a + lq2], r * Sk + where_k[d - lk2:d])


def step_forward(kernel: str, qf: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, calls: list[VarlenCall],
                 out: torch.Tensor, lse: torch.Tensor, first: bool = False) -> None:
    """Merge one step's calls into the running fp32 out [H, N, D] and lse [H, N] (qf [N, H, D], kf/vf [M, Hkv, D]).
    first: out and lse are still empty (zeros, -inf): the first call's result is stored, not merged."""
    for i, c in enumerate(calls):
        o, l = kernel_forward(kernel, qf[c.q_idx], kf[c.k_idx], vf[c.k_idx], c)
        if first and i == 0:  # a call's queries are distinct: merging into nothing is a copy
            out[:, c.q_idx], lse[:, c.q_idx] = o.transpose(0, 1).float(), l
        else:
            out[:, c.q_idx], lse[:, c.q_idx] = merge(out[:, c.q_idx], lse[:, c.q_idx], o.transpose(0, 1).float(), l)


def step_backward(kernel: str, doutf: torch.Tensor, qf: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor,
                  outf: torch.Tensor, lse: torch.Tensor, calls: list[VarlenCall], dq: torch.Tensor, dk: torch.Tensor,
                  dv: torch.Tensor) -> None:
    """Add one step's gradients into fp32 dq [N, H, D], dk/dv [M, Hkv, D] (outf, lse: the final ones)."""
    for c in calls:
        g = kernel_backward(kernel, doutf[c.q_idx], qf[c.q_idx], kf[c.k_idx], vf[c.k_idx], outf[c.q_idx],
                            lse[:, c.q_idx].contiguous(), c)
        dq.index_add_(0, c.q_idx, g[0].float())
        dk.index_add_(0, c.k_idx, g[1].float())
        dv.index_add_(0, c.k_idx, g[2].float())


def _kernel_dtype(kernel: str, x: torch.Tensor) -> torch.Tensor:
    """The FA2 kernels take 16-bit inputs only: others go as bf16 (as flash_attention does)."""
    return x if kernel == "contract" or x.dtype in (torch.float16, torch.bfloat16) else x.to(torch.bfloat16)


class VarlenContextAttention(torch.autograd.Function):
    """q [B, Sq, H, D] (this rank's queries), k/v [B, Sk, Hkv, D] (its keys) -> out like q, over `ring`'s steps
    (None: one step) with `calls[s]` per step; the ring moves k/v and, in backward, their fp32 gradients."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Optional[RingPeers],
                calls: list[list[VarlenCall]], kernel: str) -> torch.Tensor:
        B, Sq, H, D = q.shape
        qf = _kernel_dtype(kernel, q).reshape(B * Sq, H, D)
        out = torch.zeros((H, B * Sq, D), dtype=torch.float32, device=q.device)
        lse = torch.full((H, B * Sq), float("-inf"), dtype=torch.float32, device=q.device)
        own = kv = [_kernel_dtype(kernel, k), _kernel_dtype(kernel, v)]
        steps = ring.size if ring is not None else 1
        for s in range(steps):
            nxt = _shift(kv, ring) if s < steps - 1 else None
            step_forward(kernel, qf, kv[0].flatten(0, 1), kv[1].flatten(0, 1), calls[s], out, lse, first=s == 0)
            if nxt is not None:
                _wait(nxt[1])
                kv = nxt[0]
        out = out.transpose(0, 1).to(qf.dtype).contiguous()
        ctx.save_for_backward(qf, *own, out, lse)
        ctx.layout = (ring, calls, kernel, (q.dtype, k.dtype, v.dtype), k.shape)
        return out.view(B, Sq, H, D).to(q.dtype)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        qf, k, v, out, lse = ctx.saved_tensors
        ring, calls, kernel, dtypes, k_shape = ctx.layout
        doutf = dout.to(qf.dtype).reshape(qf.shape).contiguous()
        dq = torch.zeros(qf.shape, dtype=torch.float32, device=qf.device)
        grads = [torch.zeros((k_shape[0] * k_shape[1],) + k_shape[2:], dtype=torch.float32, device=qf.device)
                 for _ in range(2)]
        kv = [k, v]
        steps = ring.size if ring is not None else 1
        for s in range(steps):
            nxt = _shift(kv, ring) if s < steps - 1 else None
            step_backward(kernel, doutf, qf, kv[0].flatten(0, 1), kv[1].flatten(0, 1), out, lse, calls[s], dq,
                          *grads)
            if steps > 1:  # the accumulators move with their block; the n-th shift brings them home
                grads, works = _shift(grads, ring, tag=2)
                _wait(works)
            if nxt is not None:
                _wait(nxt[1])
                kv = nxt[0]
        return (dq.view(dout.shape).to(dtypes[0]), grads[0].view(k_shape).to(dtypes[1]),
                grads[1].view(k_shape).to(dtypes[2]), None, None, None)


def context_calls(meta: ContextMeta) -> list[list[VarlenCall]]:
    """The calls of every step of `meta` (planned once per forward, on the host, and kept on the meta)."""
    calls = vars(meta).get("varlen_calls")
    if calls is None:
        calls = [plan_calls(meta.query, src, meta.window, meta.query.index.device) for src in meta.sources]
        vars(meta)["varlen_calls"] = calls
    return calls


def varlen_context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ContextMeta, kernel: str
                             ) -> torch.Tensor:
    """q [B, Sq, H, D], k/v [B, Sk, Hkv, D] after the all-to-all -> [B, Sq, H, D], on `kernel`."""
    if kernel not in KERNELS:
        raise ValueError(f"varlen context attention: expected a kernel of {', '.join(KERNELS)}, got {kernel!r}")
    return VarlenContextAttention.apply(q, k, v, meta.ring, context_calls(meta), kernel)
