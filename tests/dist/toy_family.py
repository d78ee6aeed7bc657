"""A model family defined entirely here, registered at import: proves that adding a family needs no other file.

The toy is a stack of residual MLP blocks over token embeddings (a causal LM that looks at one token: it
learns bigram statistics). Its spec gives its module, its args from the config, its blocks (activation
checkpointing, FSDP units) and a tensor-parallel plan; nothing else in internlm_core knows it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from internlm_core.model import (ModelSpec, ParallelPlan, get_model_spec, init_parameters, model_types,
                                 register_model)


@dataclass
class ToyArgs:
    vocab_size: int
    hidden_size: int
    num_layers: int


class ToyBlock(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.up = nn.Linear(h, 2 * h, bias=False)
        self.down = nn.Linear(2 * h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(F.rms_norm(x, (x.shape[-1],)))))


class ToyLM(nn.Module):
    def __init__(self, a: ToyArgs):
        super().__init__()
        self.embed = nn.Embedding(a.vocab_size, a.hidden_size)
        self.blocks = nn.ModuleList(ToyBlock(a.hidden_size) for _ in range(a.num_layers))
        self.head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)

    def init_weights(self, seed: int = 0, buffer_device: Optional[torch.device] = None) -> None:
        # the shared helper gives every parameter a layout-independent value (see internlm_core/model/init.py)
        init_parameters(self, seed, lambda name, full, generator: full.normal_(0.0, 0.02, generator=generator))

    def forward(self, input_ids, position_ids=None, cu_seqlens=None, document_ids=None):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(F.rms_norm(h, (h.shape[-1],)))


def _tensor_parallel(model: ToyLM, mesh, options) -> None:
    parallelize_module(model, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Replicate()),  # logits gathered: a plain tensor
    })
    for block in model.blocks:
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


TOY = ModelSpec(
    name="TOY_MLP", aliases=("TOYLM",), description="test-only residual MLP language model",
    module=ToyLM,
    build_args=lambda cfg, attn_backend: ToyArgs(cfg.model.vocab_size, cfg.model.hidden_size, cfg.model.num_layers),
    plan=ParallelPlan(blocks=lambda m: list(m.blocks), apply_tensor_parallel=_tensor_parallel),
)


def register() -> ModelSpec:
    """Register the toy family (once per process)."""
    if "TOY_MLP" not in model_types():
        register_model(TOY)
    return get_model_spec("TOY_MLP")


if __name__ == "__main__":  # torchrun driver: python toy_family.py <train.py args>
    register()
    import train
    sys.exit(train.main(sys.argv[1:]))
