"""Small helpers for the monitors' own collectives (they run whether or not a process group exists)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def dist_ready() -> bool:
    """True when a default process group is initialized (a single process without one: no collectives)."""
    return dist.is_available() and dist.is_initialized()


def collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where a small tensor for a collective on `group` must live: the current CUDA device under NCCL, else CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
