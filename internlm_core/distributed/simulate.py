"""One rank of a large job on this machine: PyTorch's fake process group (collectives that move nothing)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import LaunchError
from .launch import LaunchInfo


def init_simulated(world_size: int, rank: int = 0, ranks_per_node: int = 8, device_type: str = "cpu") -> LaunchInfo:
    """Join a fake process group as `rank` of `world_size`: every collective and point-to-point call returns at
    once with buffers of the right shapes, so the rank allocates and computes exactly what it would in the real
    job (its shards, its pipeline stages, its activations) without peers. `device_type` "cuda": on this machine's
    current GPU (the rank's memory is then the CUDA allocator's), else on the CPU."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise LaunchError(f"--simulate {world_size} --simulate-rank {rank}: expected 0 <= rank < world size")
    if device_type not in ("cpu", "cuda"):
        raise LaunchError(f"--simulate-device: expected cpu or cuda, got {device_type!r}")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise LaunchError("--simulate-device cuda: this machine has no usable CUDA device")
    if dist.is_initialized():
        raise LaunchError("--simulate: a process group is already initialized (do not start it under torchrun)")
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    return LaunchInfo("simulate", rank, world_size, rank % ranks_per_node, device, "fake")
