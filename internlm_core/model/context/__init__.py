"""Context parallel attention: each of C ranks holds a zigzag chunk of every row (layout.py) and attention
still sees whole rows.

    ctx = ContextGroup(group, size, rank, mode="ring" | "all_to_all" | "2d", inner=1)
    set_context_parallel(model, ctx)  # then model(input_ids [B, T/C], position_ids [B, T/C], document_ids=[B, T/C])

One file per job: layout.py (who holds which tokens, the per-forward ContextMeta), blockwise.py (the attention core
with log-sum-exp and its hand-written backward), ring.py (k/v around the ring), ulysses.py (the all-to-all mode),
two_d.py (all-to-all inside, ring across), counters.py (bytes sent, counted and predicted).

The attention kernel follows the run's (numerics.select_kernels): "flash" and "torch_varlen" run every mode on
torch's FA2 varlen kernels with log-sum-exp (varlen.py: one causal call after the all-to-all; one or two calls per
ring step, merged by log-sum-exp); "sdpa" and "cpu_blocked" run the blockwise core (plain torch ops, the CPU path
and the reference); "varlen_contract" runs the varlen plumbing on the kernels' CPU contract (tests, gpu_check).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from .blockwise import BLOCK, blockwise_attention, one_dtype, plan_blocks
from .counters import a2a_kv_heads, pop_context_bytes, predicted_context_bytes
from .layout import (MODES, ContextGroup, ContextMeta, build_context_meta, local_positions, make_inner_group,
                     zigzag_indices)
from .two_d import two_d_attention
from .ulysses import ulysses_attention

# attention backend -> the varlen kernel its context-parallel path runs on (others: the blockwise core)
VARLEN_KERNEL = {"flash": "aten_flash", "torch_varlen": "aten_flash", "varlen_contract": "contract"}

__all__ = ["BLOCK", "MODES", "ContextGroup", "ContextMeta", "a2a_kv_heads", "blockwise_attention",
           "build_context_meta", "context_attention", "local_positions", "make_inner_group", "one_dtype", "plan_blocks",
           "pop_context_bytes", "predicted_context_bytes", "set_context_parallel", "zigzag_indices"]


@torch.compiler.disable  # host-side plans and collectives: a compiled block calls it eagerly
def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ContextMeta,
                      backend: Optional[str] = None) -> torch.Tensor:
    """q [B, T/C, H, D], k/v [B, T/C, Hkv, D] (this rank's zigzag chunk, its local heads) -> [B, T/C, H, D],
    attention over the whole rows, on the kernel of `backend` (module docstring; None: the blockwise core). q, k,
    v are computed in one dtype (`one_dtype`: autocast's, else v's)."""
    q, k, v = one_dtype(q, k, v)
    kernel = VARLEN_KERNEL.get(backend or "")
    if meta.context.mode == "all_to_all" or meta.ring is None:
        return ulysses_attention(q, k, v, meta, kernel)
    return two_d_attention(q, k, v, meta, kernel)  # ring: an all-to-all of size 1


def set_context_parallel(model: nn.Module, context: ContextGroup) -> None:
    """Put `model`'s transformers (every submodule with a `context` attribute: the model, or its pipeline chunks)
    under context parallel, and create the 2d mode's all-to-all subgroups (every rank of the group calls this)."""
    if not isinstance(context, ContextGroup):
        raise TypeError(f"set_context_parallel: expected a ContextGroup, got {type(context).__name__}")
    make_inner_group(context)
    found = 0
    for module in model.modules():
        if "context" in vars(module):
            module.context = context
            found += 1
    if not found:
        raise ValueError(f"set_context_parallel: {type(model).__name__} has no module with a `context` attribute "
                         f"(the InternLM Transformer's); this model cannot run under context parallel")
