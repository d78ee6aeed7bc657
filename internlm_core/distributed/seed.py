"""Seeding and determinism."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA) — the same on every rank, so that model init agrees."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_deterministic(enabled: bool, benchmark: bool = False) -> None:
    """cudnn_deterministic: deterministic algorithms everywhere (warn where none exists), no autotuning."""
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = benchmark and not enabled
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
