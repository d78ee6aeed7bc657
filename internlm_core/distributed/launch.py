"""Form the process group from the launcher's environment: torchrun, SLURM, or a single process.

A restarted group (torchrun `--max-restarts`, SLURM `--requeue`) forms a fresh group every time: under torchrun the
workers meet in the agent's TCP store, which outlives the workers and still holds the previous group's keys (gloo's
peer addresses among them, so that a restarted rank may dial a dead peer: "Connection refused", or wait on a
barrier counted by the dead group). Every group therefore first agrees on a generation id that no earlier group can
have written (`join_generation`) and keeps all its keys under it. Under torchrun a worker also dies with its agent
(a killed agent leaves no workers behind holding GPUs and ports).
"""

from __future__ import annotations

import ctypes
import datetime
import os
import re
import signal
import socket
import sys
import time
import uuid
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
    restart_count: int = 0  # how often the launcher restarted the job (torchrun's restarts, SLURM's requeues)
    max_restarts: Optional[int] = None  # torchrun --max-restarts (None: not told)
    generation: str = ""    # the id this group agreed on (join_generation); "" without a group

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


def tasks_on_node(env: Optional[dict] = None) -> int:
    """This job's processes on this node: torchrun's LOCAL_WORLD_SIZE, else SLURM's tasks per node (the first
    entry of SLURM_TASKS_PER_NODE, e.g. '8(x2)'), else 1."""
    env = os.environ if env is None else env
    text = env.get("LOCAL_WORLD_SIZE") or env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
    match = re.match(r"\d+", text)
    return int(match.group()) if match else 1


def isolated_gpu_warning(tasks: int, visible: int) -> Optional[str]:
    """The warning for a process that sees one GPU while `tasks` > 1 processes of the job share its node (SLURM
    --gpus-per-task=1, --gpu-bind, a per-task CUDA_VISIBLE_DEVICES): where tasks are confined to their devices
    (cgroups) NCCL cannot open the other GPUs and loses P2P/NVLink inside the node. None otherwise."""
    if visible != 1 or tasks <= 1:
        return None
    return (f"this process sees 1 GPU while {tasks} processes of the job run on its node: where tasks are confined "
            f"to their own GPU (SLURM --gpus-per-task=1 or --gpu-bind with device cgroups), NCCL cannot use P2P/NVLink "
            f"between them and goes through host memory; give every task all of the node's GPUs (--gpus-per-node, "
            f"tools/slurm/train.sbatch)")


def local_device(device_type: str, local_rank: int, visible: int) -> torch.device:
    """The device this process trains on: the CPU, or its GPU among the `visible` ones (`cuda_device_index`)."""
    if device_type != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", cuda_device_index(local_rank, visible))


def restart_count(env: Optional[dict] = None) -> int:
    """How often the launcher started this job again: torchrun's restarts (TORCHELASTIC_RESTART_COUNT) plus SLURM's
    requeues (SLURM_RESTART_COUNT)."""
    env = os.environ if env is None else env
    total = 0
    for key in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        text = env.get(key) or "0"
        try:
            total += int(text)
        except ValueError:
            raise LaunchError(f"{key}={text!r} is not an integer") from None
    return total


JOIN_PREFIX = "internlm_core/join"


def join_generation(store: dist.Store, rank: int, world_size: int, timeout_s: float,
                    poll_s: float = 0.02) -> str:
    """A generation id all `world_size` ranks of this group agree on, fresh: never written by an earlier group that
    met in the same store.

    Each rank r > 0 writes a fresh random nonce to `hello/r` and waits for `welcome/<nonce>`, a key only this rank
    can name; rank 0 draws the generation id, answers every nonce it finds (a dead rank's stale one too: harmless,
    nobody waits on it) until every rank r reported `ready/<generation>/r`, which lives under the fresh id. No key
    another group wrote can be mistaken for one of this group's.
    """
    deadline = time.monotonic() + timeout_s
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"{JOIN_PREFIX}/hello/{rank}", nonce)
        try:
            store.wait([f"{JOIN_PREFIX}/welcome/{nonce}"], datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # noqa: BLE001 - the store's timeout error, renamed for the user
            raise LaunchError(f"rank {rank}: rank 0 did not answer within {timeout_s:.0f} s while forming the "
                              f"process group of {world_size} ({e})") from None
        generation = store.get(f"{JOIN_PREFIX}/welcome/{nonce}").decode()
        store.set(f"{JOIN_PREFIX}/ready/{generation}/{rank}", "1")
        return generation
    generation = uuid.uuid4().hex[:16]
    answered: dict[int, bytes] = {}
    pending = set(range(1, world_size))
    while pending:
        for r in sorted(pending):
            if store.check([f"{JOIN_PREFIX}/ready/{generation}/{r}"]):
                pending.discard(r)
                continue
            if store.check([f"{JOIN_PREFIX}/hello/{r}"]):
                nonce = store.get(f"{JOIN_PREFIX}/hello/{r}")
                if answered.get(r) != nonce:
                    store.set(f"{JOIN_PREFIX}/welcome/{nonce.decode()}", generation)
                    answered[r] = nonce
        if pending:
            if time.monotonic() > deadline:
                missing = ", ".join(map(str, sorted(pending)))
                raise LaunchError(f"rank 0: rank(s) {missing} of {world_size} did not join within {timeout_s:.0f} s")
            time.sleep(poll_s)
    return generation


def _group_store(rank: int, world: int, timeout_s: float) -> tuple[dist.Store, str]:
    """The store this group meets in (the agent's under torchrun, else rank 0's), under a fresh generation."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise LaunchError(f"rank {rank}: MASTER_ADDR and MASTER_PORT must be set to form the process group "
                          f"(got {addr!r}, {port!r})")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(addr, int(port), world_size=world, is_master=rank == 0 and not agent_store,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                          multi_tenant=not agent_store)
    generation = join_generation(store, rank, world, timeout_s)
    return dist.PrefixStore(f"internlm_core/gen/{generation}", store), generation


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> bool:
    """Under torchrun: SIGKILL this worker when its agent dies (Linux), so that a killed agent leaves no worker
    behind. True when armed."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the agent died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)
    return True


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
    die_with_parent()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    restarts = restart_count()
    max_restarts = int(os.environ["TORCHELASTIC_MAX_RESTARTS"]) if "TORCHELASTIC_MAX_RESTARTS" in os.environ else None
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    device = local_device(device_type, local, torch.cuda.device_count() if device_type == "cuda" else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        warning = isolated_gpu_warning(tasks_on_node(), torch.cuda.device_count())
        if warning and local == 0:
            logger.warning(warning)
    if world == 1 or launcher == "none":
        return LaunchInfo("none" if world == 1 else launcher, 0, 1, 0, device, None, restarts, max_restarts)
    backend = "nccl" if device.type == "cuda" else "gloo"
    generation = ""
    if not dist.is_initialized():
        try:
            store, generation = _group_store(rank, world, timeout_s)
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout_s),
                                    device_id=device if device.type == "cuda" else None)
        except LaunchError:
            raise
        except Exception as e:
            raise LaunchError(f"rank {rank} on {socket.gethostname()}: cannot form the process group of "
                              f"{world} ({backend}, master {os.environ.get('MASTER_ADDR')}:"
                              f"{os.environ.get('MASTER_PORT')}): {e}") from None
    return LaunchInfo(launcher, rank, world, local, device, backend, restarts, max_restarts, generation)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
