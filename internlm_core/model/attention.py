"""Attention over packed rows: flash-attn's varlen kernel or SDPA with a per-document causal mask.

A packed micro-batch is `B` rows of `T` tokens whose documents are delimited by `cu_seqlens`
(offsets into the flattened B*T tokens). Tokens attend only to earlier tokens of their own document.
The data pipeline puts a boundary at every multiple of `seq_len`, so rows never share a document and
SDPA needs only a [B, 1, T, T] mask (cost B*T^2, not (B*T)^2).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ..utils.logging import get_logger

logger = get_logger(__name__)


def flash_attn_available() -> bool:
    """True when the flash-attn package can be imported (it only works on CUDA)."""
    return importlib.util.find_spec("flash_attn") is not None


def select_attention_backend(requested: str, use_flash_attn: bool, device_type: str,
                             flash_installed: Optional[bool] = None, quiet: bool = False) -> str:
    """Pick "flash" or "sdpa" and say why; `requested` is model.attn_backend (auto, flash, sdpa)."""
    if flash_installed is None:
        flash_installed = flash_attn_available()
    usable = flash_installed and device_type == "cuda"
    if requested == "sdpa":
        return "sdpa"
    if requested == "flash":
        if not usable:
            why = "flash-attn is not installed" if not flash_installed else f"device is {device_type}, not cuda"
            from ..errors import ConfigError
            raise ConfigError(f"model.attn_backend: 'flash' requested but {why}; use 'auto' or 'sdpa'")
        return "flash"
    if use_flash_attn and usable:
        return "flash"
    if use_flash_attn and not quiet:
        why = "not installed" if not flash_installed else f"no CUDA (device {device_type})"
        logger.info(f"flash-attn {why}: attention falls back to scaled_dot_product_attention with document masks")
    return "sdpa"


@dataclass
class PackedMeta:
    """Per-micro-batch attention layout, computed once and shared by every layer."""

    cu_seqlens: Optional[torch.Tensor]   # int32 [n+1] over the flattened B*T tokens; None: every row is one document
    max_seqlen: int                      # longest document (flash varlen)
    mask: Optional[torch.Tensor]         # bool [B, 1, T, T] for SDPA; None: plain causal per row


def build_packed_meta(cu_seqlens: Optional[torch.Tensor], batch: int, seqlen: int, backend: str,
                      device: torch.device) -> PackedMeta:
    """Turn cu_seqlens into what the chosen backend needs (done outside compiled regions)."""
    if cu_seqlens is None:
        return PackedMeta(None, seqlen, None)
    cu = cu_seqlens.to(device="cpu", dtype=torch.int64)
    total = batch * seqlen
    if cu[0].item() != 0 or cu[-1].item() != total or bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must rise strictly from 0 to {total} (B*T), got {cu.tolist()[:8]}...")
    row_starts = torch.arange(0, total + 1, seqlen)
    if not bool(torch.isin(row_starts, cu).all()):
        raise ValueError(f"cu_seqlens must contain every multiple of the row length {seqlen}")
    lengths = cu[1:] - cu[:-1]
    max_seqlen = int(lengths.max().item())
    if backend == "flash":
        return PackedMeta(cu_seqlens.to(device=device, dtype=torch.int32), max_seqlen, None)
    if len(cu) - 1 == batch:  # one document per row: the fused causal kernel, no mask
        return PackedMeta(None, max_seqlen, None)
    seg = torch.repeat_interleave(torch.arange(len(lengths)), lengths).view(batch, seqlen)
    same_doc = seg.unsqueeze(2) == seg.unsqueeze(1)
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool).tril()
    mask = (same_doc & causal).unsqueeze(1).to(device)
    return PackedMeta(None, max_seqlen, mask)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PackedMeta, backend: str) -> torch.Tensor:
    """q [B, T, H, D], k/v [B, T, Hkv, D] → [B, T, H, D]; causal within each document."""
    B, T, H, D = q.shape
    if backend == "flash" and meta.cu_seqlens is not None:
        from flash_attn import flash_attn_varlen_func
        out = flash_attn_varlen_func(q.reshape(B * T, H, D), k.reshape(B * T, -1, D), v.reshape(B * T, -1, D),
                                     meta.cu_seqlens, meta.cu_seqlens, meta.max_seqlen, meta.max_seqlen,
                                     causal=True)
        return out.view(B, T, H, D)
    if backend == "flash":
        from flash_attn import flash_attn_func
        return flash_attn_func(q, k, v, causal=True)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = k.shape[1] != H
    if meta.mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.mask, enable_gqa=gqa)
    return out.transpose(1, 2)
