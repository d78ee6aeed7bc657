"""Activation checkpointing and compilation of a family's blocks (InternLM's `model.checkpoint`, `model.compile`)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def _checkpointed(inner: Callable) -> Callable:
    def forward(*args, **kwargs):
        if torch.is_grad_enabled():  # recompute in backward; evaluation keeps nothing anyway
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
        return inner(*args, **kwargs)
    return forward


def checkpoint_and_compile(blocks: list[nn.Module], setting: bool | float, compile: bool) -> int:
    """Recompute the first round(fraction * len(blocks)) blocks in backward and, with `compile`, compile every
    block (inside the recomputed function for checkpointed ones, never checkpointing inside a graph).
    Returns how many blocks are checkpointed. Parameter names do not change (no wrapper modules)."""
    frac = 1.0 if setting is True else 0.0 if setting is False else float(setting)
    n = round(frac * len(blocks))
    for i, block in enumerate(blocks):
        if i < n:
            inner = block.forward  # the class's forward, bound
            block.forward = _checkpointed(torch.compile(inner) if compile else inner)
        elif compile:
            block.compile()
    return n
