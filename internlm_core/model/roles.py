"""Which parameters are the hidden matrices (optimizer.name = "muon" updates these with Muon, the rest with AdamW).

The rule, for every family: a parameter of >= 2 dims inside one of the transformer blocks (`ParallelPlan.blocks`:
the attention and MLP weights; a 3-D MoE expert weight [E, rows, columns] counts as E matrices) is a hidden matrix,
except the MoE routers' gate weights [E, h] (a classifier over experts, as the output head is over the vocabulary).
Everything else is not: the token embeddings and the output head (outside the blocks, tied or not), the final and
per-block norms and the biases (1-D)."""

from __future__ import annotations

from typing import Iterable

import torch.nn as nn

from .moe.router import Router


def hidden_matrices(model: nn.Module, blocks: Iterable[nn.Module]) -> list[nn.Parameter]:
    """The hidden matrices of `model` (the module docstring's rule), in `model.parameters()` order; `blocks` is the
    family plan's `blocks(model)` (under pipeline parallel: this rank's stages)."""
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    routers = {id(p) for m in model.modules() if isinstance(m, Router) for p in m.parameters()}
    return [p for p in model.parameters() if p.requires_grad and p.dim() >= 2 and id(p) in in_blocks
            and id(p) not in routers]
