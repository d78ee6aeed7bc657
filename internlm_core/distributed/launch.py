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
    """Host names of a SLURM node list, in order, as `scontrol show hostnames` prints them.

    `node[01-03,07],gpu5` → node01 node02 node03 node07 gpu5: ranges keep the zero padding of their
    start; several bracket groups in one name expand as a product (`r[1-2]n[1-2]` → r1n1 r1n2 r2n1 r2n2).
    """
    hosts: list[str] = []
    for name in _split_top_level(nodelist):
        hosts.extend(_expand_host(name, nodelist))
    if not hosts:
        raise LaunchError(f"SLURM node list {nodelist!r}: no host names in it")
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in nodelist.strip():
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if depth < 0 or depth > 1:
            raise LaunchError(f"SLURM node list {nodelist!r}: unbalanced or nested brackets")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise LaunchError(f"SLURM node list {nodelist!r}: unbalanced brackets")
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def _expand_host(name: str, nodelist: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", name)
    if not m:
        return [name]
    prefix, body, rest = name[:m.start()], m.group(1), name[m.end():]
    tails = _expand_host(rest, nodelist)
    out: list[str] = []
    for item in body.split(","):
        item = item.strip()
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise LaunchError(f"SLURM node list {nodelist!r}: {item!r} is not a number or a range like 01-03")
        if sep and int(hi) < int(lo):
            raise LaunchError(f"SLURM node list {nodelist!r}: range {item!r} runs backwards")
        values = [f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1)] if sep else [lo]
        out.extend(prefix + v + t for v in values for t in tails)
    return out


def slurm_env_to_torch(env: Optional[dict] = None, default_port: int = 29500) -> dict[str, str]:
    """RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT derived from SLURM's variables."""
    env = os.environ if env is None else env
    values = {}
    for key in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        text = env.get(key, "0" if key == "SLURM_LOCALID" else None)
        if text is None:
            raise LaunchError(f"launcher slurm: environment variable {key} is not set (run under srun)")
        try:
            values[key] = int(text)
        except ValueError:
            raise LaunchError(f"launcher slurm: {key}={text!r} is not an integer") from None
    rank, world, local = values["SLURM_PROCID"], values["SLURM_NTASKS"], values["SLURM_LOCALID"]
    if not 0 <= rank < world:
        raise LaunchError(f"launcher slurm: SLURM_PROCID {rank} is outside [0, SLURM_NTASKS={world})")
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


def cuda_device_index(local_rank: int, visible: int) -> int:
    """This process's GPU among the `visible` ones: the only one when it sees one (SLURM --gpus-per-task=1 or a
    per-task CUDA_VISIBLE_DEVICES), else its local rank (torchrun, or SLURM with every GPU of the node visible)."""
    if visible == 1:
        return 0
    if 0 <= local_rank < visible:
        return local_rank
    raise LaunchError(f"local rank {local_rank} has no GPU: this process sees {visible} "
                      f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); give each node as "
                      f"many GPUs as tasks, or one GPU per task")


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
    device = torch.device("cuda", cuda_device_index(local, torch.cuda.device_count())) if device_type == "cuda" \
        else torch.device("cpu")
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
