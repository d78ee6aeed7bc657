"""Form the process group from the launcher's environment: torchrun, SLURM, or a single process."""

from __future__ import annotations

import datetime
import os
import re
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import LaunchError
from ..utils.logging import get_logger

logger = get_logger(__name__)


@dataclass
class LaunchInfo:
    """Who this process is and where it computes."""

    launcher: str          # "torch", "slurm" or "none"
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: Optional[str]  # None when no process group was formed (single process)

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def detect_launcher(env: Optional[dict] = None) -> str:
    """"torch" when torchrun set RANK, "slurm" under srun (SLURM_PROCID without RANK), else "none"."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torch"
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return "slurm"
    return "none"


def expand_nodelist(nodelist: str) -> list[str]:
    """`node[01-03,07],gpu5` → ["node01", "node02", "node03", "node07", "gpu5"], as `scontrol show hostnames`."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,\[]*", nodelist):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            if "-" in r:
                lo, hi = r.split("-", 1)
                width = len(lo)
                hosts.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(f"{prefix}{r}{suffix}")
    return hosts


def slurm_env_to_torch(env: Optional[dict] = None, default_port: int = 29500) -> dict[str, str]:
    """RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT derived from SLURM's variables."""
    env = os.environ if env is None else env
    try:
        rank, world, local = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    except KeyError as e:
        raise LaunchError(f"launcher slurm: environment variable {e.args[0]} is not set (run under srun)") from None
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise LaunchError("launcher slurm: neither MASTER_ADDR nor SLURM_JOB_NODELIST is set")
        addr = expand_nodelist(nodelist)[0]
    port = env.get("MASTER_PORT")
    if not port:  # one port per job, so that two jobs sharing a node do not collide
        job = int(env.get("SLURM_JOB_ID", "0") or 0)
        port = str(default_port + job % 10000)
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
            "MASTER_ADDR": addr, "MASTER_PORT": port}


def init_distributed(launcher: Optional[str] = None, timeout_s: float = 600.0,
                     device_type: Optional[str] = None) -> LaunchInfo:
    """Initialize torch.distributed for this process; single process (world size 1) forms no group.

    Backend from the device: nccl on CUDA, gloo on CPU. `timeout_s` bounds every collective, so
    that a rank whose peer died does not wait forever.
    """
    launcher = launcher or detect_launcher()
    if launcher not in ("torch", "slurm", "none"):
        raise LaunchError(f"--launcher: expected torch or slurm, got {launcher!r}")
    if launcher == "slurm":
        os.environ.update(slurm_env_to_torch())
    if launcher == "torch" and "RANK" not in os.environ:
        raise LaunchError("launcher torch: RANK/WORLD_SIZE are not set; start with torchrun")
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(f"cuda:{local}") if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world == 1 or launcher == "none":
        return LaunchInfo("none" if world == 1 else launcher, 0, 1, 0, device, None)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend=backend, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout_s),
                                    device_id=device if device.type == "cuda" else None)
        except Exception as e:
            raise LaunchError(f"rank {rank} on {socket.gethostname()}: cannot form the process group of "
                              f"{world} ({backend}, master {os.environ.get('MASTER_ADDR')}:"
                              f"{os.environ.get('MASTER_PORT')}): {e}") from None
    return LaunchInfo(launcher, rank, world, local, device, backend)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
