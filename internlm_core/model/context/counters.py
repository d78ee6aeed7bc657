"""Bytes this process sent for context parallel, counted where they are sent, and the same from the shape alone.

Keys: "ring", "all_to_all", "2d" (the attention exchanges of each mode, forward and backward, every layer) and
"layout" (the all-gather of the document ids, once per forward). What a rank keeps for itself is not sent; an
all-gather counts as C - 1 copies of the local part (a ring all-gather's sends).
"""

from __future__ import annotations

import math

_SENT: dict[str, int] = {"ring": 0, "all_to_all": 0, "2d": 0, "layout": 0}


def count_bytes(key: str, nbytes: int) -> None:
    """Add `nbytes` sent by this process under `key`."""
    _SENT[key] += int(nbytes)


def pop_context_bytes() -> dict[str, int]:
    """Bytes sent by this process per key since the last call, and reset."""
    out = dict(_SENT)
    for key in _SENT:
        _SENT[key] = 0
    return out


def a2a_kv_heads(kv_heads: int, size: int) -> int:
    """k/v heads after repeating them for an all-to-all over `size` ranks: the least multiple of `kv_heads` that
    `size` divides (each rank needs whole k/v heads for its H / size query heads)."""
    return kv_heads * size // math.gcd(kv_heads, size)


def predicted_context_bytes(mode: str, size: int, inner: int, batch: int, seq_len: int, heads: int, kv_heads: int,
                            head_dim: int, dtype_bytes: int, layers: int) -> int:
    """Bytes one context rank sends for the attention of one forward and backward of `layers` layers (what the
    counter's `mode` key reads), from the shape; heads / kv_heads are a rank's own (after tensor parallel).

    With T = seq_len / size tokens per rank, a = the all-to-all size (all_to_all: size, 2d: inner, ring: 1),
    n = size / a ring positions, Hk = kv heads after repeating to a multiple of a (`a2a_kv_heads`):
      all-to-all: q, k, v, out forward and dout, dq, dk, dv backward, each sending (a - 1) / a of the rank's
                  [batch, T, heads, head_dim]: 2 * (2 * heads + 2 * Hk) * batch * T * head_dim * (a - 1) / a
      ring:       forward n - 1 shifts of k and v, backward n - 1 shifts of k and v and n shifts of the fp32 dk/dv
                  accumulators (the last brings them home); one shift is 2 * batch * (Hk / a) * (a T) * head_dim
    Not included: the document-id all-gather ("layout"), and forwards repeated by activation checkpointing (each
    repeats the forward's share)."""
    if size % inner or (mode != "2d" and inner != 1):
        raise ValueError(f"predicted_context_bytes: inner {inner} must divide size {size} (and be 1 unless mode 2d)")
    a = {"ring": 1, "all_to_all": size, "2d": inner}[mode]
    n, tokens = size // a, seq_len // size
    hk = a2a_kv_heads(kv_heads, a)
    total = 0
    if a > 1:
        total += 2 * (2 * heads + 2 * hk) // a * (a - 1) * batch * tokens * head_dim * dtype_bytes
    if n > 1:
        shift = 2 * batch * hk * tokens * head_dim  # (Hk / a) heads of a * T tokens
        total += 2 * (n - 1) * shift * dtype_bytes + n * shift * 4
    return total * layers
