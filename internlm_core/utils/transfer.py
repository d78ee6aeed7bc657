"""Host-to-device copies that do not make the host wait for the device."""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`. A host tensor goes to a CUDA device through pinned memory, asynchronously: a copy from
    pageable memory makes the host wait (with non_blocking=True as well), which a pinned one does not."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
