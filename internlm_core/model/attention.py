"""Attention over packed rows, by the kernel `numerics.select_kernels` chose (`ModelArgs.attn_backend`):

    flash        flash-attn 2's varlen kernel takes `cu_seqlens` directly (16-bit q/k/v; others are cast to bf16)
    torch_varlen torch's varlen_attn (the FA2 kernels inside torch) with the same `cu_seqlens` and window
    sdpa         torch's scaled_dot_product_attention, with a dense [B, 1, T, T] document mask for packed rows
    cpu_blocked  plain matmuls in blocks of query rows (`blocked_causal_attention`): scores above the diagonal
                 blocks are never computed, packed documents add a precomputed per-block mask; 16-bit inputs run
                 at the 16-bit matmul rate, which SDPA's CPU kernels do not reach (the CPU path)

A packed micro-batch is `B` rows of `T` tokens whose documents are delimited by `cu_seqlens`
(offsets into the flattened B*T tokens). Tokens attend only to earlier tokens of their own document.
The data pipeline puts a boundary at every multiple of `seq_len`, so rows never share a document.
The layout is computed on the host from host tensors and copied to the device without waiting for it.

The same layout can be given per token as `document_ids` [B, T] (equal ids = same document, compared
within a row only). Unlike one `cu_seqlens` per micro-batch, document ids split along the batch dimension
with the other inputs, which is what pipeline-parallel micro-batching needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ..utils.transfer import to_device
from .context import ContextGroup, ContextMeta, build_context_meta, context_attention, one_dtype



# the kernels that take cu_seqlens (no mask is built for them)
VARLEN_BACKENDS = ("flash", "torch_varlen")


def default_attention_backend(device_type: str) -> str:
    """The kernel of a model built outside a run, where nothing is probed: cpu_blocked on CPU, sdpa elsewhere.
    A run passes the kernel `numerics.select_kernels` chose (flash-attn when installed, working and 16-bit)."""
    return "cpu_blocked" if device_type == "cpu" else "sdpa"


@dataclass
class PackedMeta:
    """Per-micro-batch attention layout, computed once and shared by every layer."""

    cu_seqlens: Optional[torch.Tensor]   # int32 [n+1] over the flattened B*T tokens; None: every row is one document
    max_seqlen: int                      # longest document (flash varlen)
    mask: Optional[torch.Tensor]         # bool [B, 1, T, T] for SDPA (True = attend); None: plain causal per row
    # CPU: per query block of `blocked_causal_attention`, bool [B, 1, rows, keys] True where a score is
    # masked out (another document or the future); None: no documents inside rows (plain causal)
    block_masks: Optional[list[torch.Tensor]] = None
    # sliding-window attention (Mistral): a query sees at most `window` keys, itself included; the masks above
    # already hold it, flash gets it as its window_size; None: the whole document
    window: Optional[int] = None
    # context parallel (model/context): the rank holds a zigzag chunk of every row; attention goes through
    # context_attention with this layout (the fields above are unused); None: whole rows on this rank
    context: Optional[ContextMeta] = None


def document_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """int64 [B, T]: the index of each token's `cu_seqlens` segment (the inverse of `cu_seqlens_from_document_ids`)."""
    cu = cu_seqlens.to(device="cpu", dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1]).view(batch, seqlen)


def cu_seqlens_from_document_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """int32 offsets over the flattened B*T tokens: a boundary where the id changes and at every row start."""
    B, T = document_ids.shape
    flat = document_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::T] = True
    end = torch.tensor([B * T], device=flat.device)
    return torch.cat([starts.nonzero().flatten(), end]).to(torch.int32)


def _causal_document_mask(seg: torch.Tensor, window: Optional[int] = None) -> torch.Tensor:
    """bool [B, 1, T, T] from per-token document ids [B, T]: same document, not in the future (and, with a
    sliding `window`, fewer than `window` positions back)."""
    T = seg.shape[1]
    same_doc = seg.unsqueeze(2) == seg.unsqueeze(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=seg.device).tril()
    if window is not None:
        causal = causal.triu(1 - window)  # query i keeps keys i - window + 1 .. i (transformers' sliding window)
    return (same_doc & causal).unsqueeze(1)


def block_document_masks(seg: torch.Tensor, block: Optional[int] = None,
                         window: Optional[int] = None) -> list[torch.Tensor]:
    """For `blocked_causal_attention` over packed rows: per query block [s, e), bool [B, 1, e - s, e], True
    where query and key lie in different documents, the key is in the future (or, with a sliding `window`,
    `window` or more positions back). `seg` [B, T] document ids."""
    B, T = seg.shape
    block = block or CAUSAL_BLOCK
    future = _future_mask(T, seg.device)
    if window is not None:
        future = future | torch.ones(T, T, dtype=torch.bool, device=seg.device).tril(-window)
    masks = []
    for s in range(0, T, block):
        e = min(s + block, T)
        other = seg[:, s:e].unsqueeze(2) != seg[:, :e].unsqueeze(1)
        masks.append((other | future[s:e, :e]).unsqueeze(1))
    return masks


def _layout_for_documents(seg: torch.Tensor, backend: str, device: torch.device, window: Optional[int] = None
                          ) -> tuple[Optional[torch.Tensor], Optional[list]]:
    """(dense SDPA mask, blocked attention's block masks) for rows holding several documents (or under a sliding
    window); one is None."""
    if backend == "cpu_blocked":
        return None, block_document_masks(to_device(seg, device), window=window)
    return _causal_document_mask(to_device(seg, device), window), None


def build_packed_meta(cu_seqlens: Optional[torch.Tensor], batch: int, seqlen: int, backend: str,
                      device: torch.device, document_ids: Optional[torch.Tensor] = None,
                      window: Optional[int] = None, context: Optional[ContextGroup] = None) -> PackedMeta:
    """Turn cu_seqlens (or per-token document_ids) into what `backend` needs (outside compiled regions).
    window: sliding-window attention (keys per query, itself included); None or >= seqlen: none. Under a window
    rows of one document need a mask too (SDPA's and the blocked attention's fused causal paths have no window).

    The layout is read on the host: give host tensors (the trainer does) and the device never waits for the
    host; document ids on the device are copied to the host once (a synchronization).

    context: under context parallel `seqlen` is the local length T/C and `document_ids` [B, T/C] the local
    chunk's (None: one document per row); cu_seqlens, which describe whole rows, are refused."""
    if context is not None:
        if cu_seqlens is not None and document_ids is None:
            raise ValueError("under context parallel give document_ids of the rank's chunk [B, T/C], not cu_seqlens")
        meta = build_context_meta(context, document_ids, batch, seqlen, device, window)
        return PackedMeta(None, seqlen * context.size, None, context=meta)
    window = window if window is not None and window < seqlen else None
    if document_ids is not None:
        if tuple(document_ids.shape) != (batch, seqlen):
            raise ValueError(f"document_ids must have shape [{batch}, {seqlen}] (B, T), got {list(document_ids.shape)}")
        ids = document_ids.cpu()
        cu = cu_seqlens_from_document_ids(ids)
        if backend in VARLEN_BACKENDS:
            return PackedMeta(to_device(cu, device), int((cu[1:] - cu[:-1]).max()), None, window=window)
        if len(cu) - 1 == batch and window is None:  # one document per row: the fused causal kernel, no mask
            return PackedMeta(None, seqlen, None)
        mask, blocks = _layout_for_documents(ids, backend, device, window)
        return PackedMeta(None, seqlen, mask, blocks, window)
    if cu_seqlens is None:
        if window is None:
            return PackedMeta(None, seqlen, None)
        cu_seqlens = torch.arange(0, batch * seqlen + 1, seqlen, dtype=torch.int64)
    cu = cu_seqlens.to(device="cpu", dtype=torch.int64)
    total = batch * seqlen
    if cu[0].item() != 0 or cu[-1].item() != total or bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must rise strictly from 0 to {total} (B*T), got {cu.tolist()[:8]}...")
    row_starts = torch.arange(0, total + 1, seqlen)
    if not bool(torch.isin(row_starts, cu).all()):
        raise ValueError(f"cu_seqlens must contain every multiple of the row length {seqlen}")
    lengths = cu[1:] - cu[:-1]
    max_seqlen = int(lengths.max().item())
    if backend in VARLEN_BACKENDS:
        return PackedMeta(to_device(cu.to(torch.int32), device), max_seqlen, None, window=window)
    if len(cu) - 1 == batch and window is None:  # one document per row: the fused causal kernel, no mask
        return PackedMeta(None, max_seqlen, None)
    mask, blocks = _layout_for_documents(document_ids_from_cu_seqlens(cu, batch, seqlen), backend, device, window)
    return PackedMeta(None, max_seqlen, mask, blocks, window)


# Query rows per block of `blocked_causal_attention`.
CAUSAL_BLOCK = 256
_MASKS: dict = {}


def _future_mask(T: int, device: torch.device) -> torch.Tensor:
    """bool [T, T], True above the diagonal (keys in the future), cached per (T, device)."""
    key = (T, str(device))
    m = _MASKS.get(key)
    if m is None:
        m = _MASKS[key] = torch.ones(T, T, dtype=torch.bool, device=device).triu(1)
    return m


def blocked_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int = CAUSAL_BLOCK,
                             masks: Optional[list[torch.Tensor]] = None) -> torch.Tensor:
    """Causal attention, q/k [N, H(kv), T, D], v [N, Hkv, T, Dv] -> [N, H, T, Dv], as plain matmuls and a softmax.

    Queries go in blocks of `block` rows; block i attends to keys [0, end of block i), so the scores above
    the diagonal blocks are never computed (about (1 + 1/n) / 2 of the square for n blocks). Scores come
    from a matmul in the input dtype (as HF's eager attention), the softmax is fp32. On CPU this beats
    SDPA's kernels: 16-bit matmuls run at the 16-bit matmul rate (SDPA's bf16 paths do not), and
    autograd's backward is plain matmuls too. `masks` (from `block_document_masks`, one per block of the
    same size) confine each query to its own document in packed rows.
    """
    N, H, T, D = q.shape
    hkv = k.shape[1]
    q = q * D**-0.5
    if hkv != H:  # grouped-query attention: each key/value head serves H / hkv query heads
        q = q.view(N, hkv, H // hkv, T, D)
        k, v = k.unsqueeze(2), v.unsqueeze(2)
    if masks is None:
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1) if torch.compiler.is_compiling() \
            else _future_mask(T, q.device)
    outs = []
    for i, s in enumerate(range(0, T, block)):
        e = min(s + block, T)
        scores = torch.matmul(q[..., s:e, :], k[..., :e, :].transpose(-1, -2))
        if masks is None:
            scores[..., s:e].masked_fill_(future[s:e, s:e], float("-inf"))  # only the diagonal block has a future
        else:
            m = masks[i]
            scores.masked_fill_(m.unsqueeze(1) if hkv != H else m, float("-inf"))
        p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        outs.append(torch.matmul(p, v[..., :e, :]))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
    return out.reshape(N, H, T, v.shape[-1])  # v's head dim may differ from q/k's (latent attention)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PackedMeta) -> torch.Tensor:
    """flash-attn 2 on [B, T, H, D] inputs (varlen over `meta.cu_seqlens` for packed rows). The kernels take
    16-bit inputs only: fp32 q/k/v (model.dtype torch.float32 / tf32 with attn_backend="flash") are cast to
    bf16 for the kernel and the output back, as InternLM does."""
    from flash_attn import flash_attn_func, flash_attn_varlen_func
    B, T, H, D = q.shape
    dtype = q.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        q, k, v = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
    # a sliding window of w keys is flash's left window w - 1 (the query itself is the w-th)
    window = (meta.window - 1, 0) if meta.window is not None else (-1, -1)
    if meta.cu_seqlens is None:
        return flash_attn_func(q, k, v, causal=True, window_size=window).to(dtype)
    out = flash_attn_varlen_func(q.reshape(B * T, H, D), k.reshape(B * T, -1, D), v.reshape(B * T, -1, D),
                                 meta.cu_seqlens, meta.cu_seqlens, meta.max_seqlen, meta.max_seqlen, causal=True,
                                 window_size=window)
    return out.view(B, T, H, D).to(dtype)


def torch_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PackedMeta) -> torch.Tensor:
    """torch's varlen_attn (FA2 inside torch, torch >= 2.11) on [B, T, H, D] inputs, over `meta.cu_seqlens`; rows
    that are one document each take SDPA's causal kernel (no mask). 16-bit kernels: fp32 inputs go as bf16."""
    if meta.cu_seqlens is None:
        return sdpa_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None).transpose(1, 2)
    from torch.nn.attention.varlen import varlen_attn
    from ..utils.torch_compat import varlen_attn_gqa
    B, T, H, D = q.shape
    dtype = q.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        q, k, v = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
    window = (meta.window - 1, 0) if meta.window is not None else (-1, 0)  # (-1, 0): causal
    out = varlen_attn(q.reshape(B * T, H, D), k.reshape(B * T, -1, D), v.reshape(B * T, -1, D), meta.cu_seqlens,
                      meta.cu_seqlens, meta.max_seqlen, meta.max_seqlen, window_size=window,
                      **(varlen_attn_gqa() if k.shape[2] != H else {}))
    return out.view(B, T, H, D).to(dtype)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                   repeat_kv: Optional[bool] = None) -> torch.Tensor:
    """torch's SDPA on [N, H, T, D] / [N, Hkv, T, D], causal or under a document mask.

    Grouped-query attention with a mask: CUDA's memory-efficient kernel takes a mask but not fewer k/v heads,
    and flash takes no mask, so `enable_gqa` would fall to the math kernel (which keeps the fp32 probabilities,
    [N, H, T, T], for backward); k/v are repeated to the query heads there instead (`repeat_kv`, default: on
    CUDA). CPU's flash kernel takes both, and repeating would only keep larger k/v."""
    gqa = k.shape[1] != q.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if gqa and (q.is_cuda if repeat_kv is None else repeat_kv):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        gqa = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PackedMeta, backend: str) -> torch.Tensor:
    """q [B, T, H, D], k/v [B, T, Hkv, D] -> [B, T, H, D]; causal within each document; `backend` as chosen by
    numerics.select_kernels ("flash", "torch_varlen", "sdpa", "cpu_blocked"). Under context parallel
    (meta.context) T is the rank's chunk: flash and torch_varlen run torch's FA2 varlen kernels, the others
    model/context's blockwise core (context_attention). q, k, v go in one dtype
    (`context.one_dtype`: autocast's, else v's), whatever dtype a norm or rotary handed q and k on in."""
    q, k, v = one_dtype(q, k, v)
    if meta.context is not None:
        return context_attention(q, k, v, meta.context, backend)
    if backend == "flash":
        return flash_attention(q, k, v, meta)
    if backend == "torch_varlen":
        return torch_varlen_attention(q, k, v, meta)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if backend == "cpu_blocked" and meta.mask is None:
        out = blocked_causal_attention(q, k, v, masks=meta.block_masks)
    elif backend == "cpu_blocked":  # a layout built with a dense document mask (bench/ablation.py -blocked_doc)
        out = sdpa_attention(q, k, v, meta.mask)
    elif backend == "sdpa":
        out = sdpa_attention(q, k, v, meta.mask)
    else:
        raise ValueError(f"attention backend: expected flash, torch_varlen, sdpa or cpu_blocked, got {backend!r}")
    return out.transpose(1, 2)
