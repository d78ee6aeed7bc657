"""Apply parallelism to a built model: tensor parallel → activation checkpointing → compile → FSDP."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..config import Config
from ..distributed.parallel_dims import ParallelDims
from ..errors import ConfigError
from ..model import apply_activation_checkpointing
from ..utils.logging import get_logger
from .fsdp import apply_fsdp

logger = get_logger(__name__)


def parallelize_model(model: nn.Module, cfg: Config, dims: ParallelDims) -> nn.Module:
    """The model, parallelized in place according to `cfg.parallel` and `dims`."""
    if dims.tp > 1 or dims.pp > 1:
        raise ConfigError("parallel.tensor / parallel.pipeline > 1 are not available in this build yet")
    n = apply_activation_checkpointing(model, cfg.model.checkpoint)
    if n:
        logger.info(f"activation checkpointing on {n} of {len(model.layers)} layers")
    if cfg.model.compile:
        for layer in model.layers.values():
            layer.compile()
    if dims.dp > 1:
        apply_fsdp(model, dims)
    return model


__all__ = ["apply_fsdp", "parallelize_model"]
