"""Does a run fit this machine? The estimator's peak of each rank against the memory free for it, before any large
allocation (trainer/build.py calls `check_memory` after the meta-device layout and before materializing).

Free memory: on CUDA the device's (`torch.cuda.mem_get_info`, measured once the CUDA context exists, so the context
is already taken off; the estimator counts tensors only); on CPU the host's available RAM (psutil, and the cgroup's
limit where one is set), shared by the ranks of the node: each gets its share. `memory_limit_gib` replaces the
measurement ("pretend this much is free per device": a smaller machine, or room kept for something else).

Verdicts against the estimator's measured error `ESTIMATE_MARGIN`: "fits" when the estimate plus the margin fits;
"near" when the estimate minus the margin fits (warn and run); "over" when even that does not (refused in one line
naming both numbers and the nearest layouts that fit; `memory_check="warn"` or `train.py --force` runs anyway,
`memory_check="off"` skips the check). Every rank measures its own and all agree on the worst (one collective of
small objects), so that no rank materializes while another refuses.
"""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path
from typing import Any, Optional

import psutil
import torch

from ..config import Config, build_config, config_to_dict
from ..config.recompute import fused_head_of
from ..errors import ConfigError, InternLMCoreError
from ..utils import collectives
from ..utils.logging import get_logger
from .core import estimate
from .figures import GiB

logger = get_logger(__name__)

# The largest deviation of a measured peak from the estimate: peak / estimate 0.85 to 1.06 in the CPU runs of
# tests/unit/test_estimate.py (bf16 fp32_gemm 0.85, fp32 1.02; live tensors 1.01-1.06) and 0.94-0.99 in the
# README's simulate table (7B@8, 20B@64, 70B@256).
ESTIMATE_MARGIN = 0.15
MEMORY_CHECKS = ("refuse", "warn", "off")
_CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "inactive_file",
                  "/sys/fs/cgroup/memory.stat"),
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
                  "total_inactive_file", "/sys/fs/cgroup/memory/memory.stat"))


@dataclasses.dataclass
class RankMemory:
    """One rank's figures: the estimator's peak for it, the memory free for it (bytes) and where that comes from."""

    rank: int
    host: str
    need: float
    free: float
    source: str
    shared: bool = False  # the figure is the host's RAM, which the host's ranks share

    @property
    def verdict(self) -> str:
        if self.need * (1 + ESTIMATE_MARGIN) <= self.free:
            return "fits"
        return "near" if self.need * (1 - ESTIMATE_MARGIN) <= self.free else "over"


def _read_int(path: str) -> Optional[int]:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_available() -> Optional[int]:
    """What this process's memory cgroup (v2, else v1) still allows: its limit less its usage, the inactive page
    cache counted as free (the kernel reclaims it before it kills); None without a limit."""
    for limit_file, usage_file, inactive_key, stat_file in _CGROUP_FILES:
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is None or usage is None or limit >= 1 << 60:
            continue
        inactive = 0
        try:
            for line in Path(stat_file).read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == inactive_key and value.strip().isdigit():
                    inactive = int(value)
        except OSError:
            pass
        return max(0, limit - usage + inactive)
    return None


def free_memory(device: torch.device, limit_gib: Optional[float] = None) -> tuple[float, str]:
    """(bytes free, where that figure comes from) for one process on `device`, before the local share."""
    if limit_gib is not None:
        return limit_gib * GiB, f"memory_limit_gib={limit_gib:g}"
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return float(free), f"{device} free of {total / GiB:.1f} GiB"
    available, where = float(psutil.virtual_memory().available), "host RAM available"
    cgroup = cgroup_available()
    if cgroup is not None and cgroup < available:
        available, where = float(cgroup), "the memory cgroup's limit less its usage"
    return available, where


def memory_need(cfg: Config, world_size: int, device_type: str, kernels: Any = None,
                pipeline_rank: Optional[int] = None, layout_kernels: bool = True) -> float:
    """The estimator's peak bytes of one rank (of pipeline stage `pipeline_rank`, else the busiest) on devices of
    `device_type`, with the run's kernels where given (`layout_kernels` False: not the gradient reduction, which
    depends on the layout); what the process holds already is not counted (CPU: it is resident, so it is not in
    the available figure either)."""
    kw: dict[str, Any] = {}
    if kernels is not None:
        kw = dict(attention=kernels.attention, linear=kernels.linear,
                  grad_reduce=kernels.grad_reduce if layout_kernels else None)
    return estimate(cfg, world_size, device=device_type, pipeline_rank=pipeline_rank, **kw).memory.total


def _variant(cfg: Config, world_size: int, sets: dict[str, Any]) -> Optional[Config]:
    """`cfg` with dotted keys set, validated for `world_size`; None when that layout is not valid."""
    raw = config_to_dict(cfg)
    for key, value in sets.items():
        node = raw
        *path, last = key.split(".")
        for k in path:
            node = node.setdefault(k, {})
        node[last] = value
    if "data.micro_bsz" in sets:
        raw["data"]["packed_length"] = None  # derived again: seq_len * micro_bsz
    try:
        return build_config(raw, source="layout", world_size=world_size)
    except (InternLMCoreError, ValueError, TypeError):
        return None


def _candidates(cfg: Config, world_size: int) -> list[tuple[str, int, dict[str, Any]]]:
    """(kind, world size, keys) of the layouts to try, nearest first within a kind: one change at this world size
    (full sharding, recomputation, a smaller micro-batch with more of them, tensor or pipeline parallel), the
    savers together, then more devices (as configured, or with the savers)."""
    d, p = cfg.data, cfg.parallel
    out: list[tuple[str, int, dict[str, Any]]] = []
    if p.zero1 > 0:
        out.append(("zero1", world_size, {"parallel.zero1": -1}))
    if cfg.model.checkpoint is not True:
        out.append(("checkpoint", world_size, {"model.checkpoint": True}))
    bsz = d.micro_bsz // 2
    while bsz >= 1:
        out.append(("micro_bsz", world_size,
                    {"data.micro_bsz": bsz, "data.micro_num": d.micro_num * d.micro_bsz // bsz}))
        bsz //= 2
    for size in (2, 4, 8):
        out.append(("tensor", world_size, {"parallel.tensor": p.tensor * size}))
    for size in (2, 4, 8):
        out.append(("pipeline", world_size, {"parallel.pipeline": p.pipeline * size,
                                             "data.micro_num": max(d.micro_num, p.pipeline * size)}))
    savers = {"parallel.zero1": -1, "model.checkpoint": True, "data.micro_bsz": 1,
              "data.micro_num": d.micro_num * d.micro_bsz}
    out.append(("savers", world_size, savers))
    # zero1 as configured may have been cut to this world size (fit_zero1_to_world): more devices shard over all
    more = {} if p.zero1 <= 0 else {"parallel.zero1": -1}
    for factor in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        out += [("devices", world_size * factor, more), ("devices_savers", world_size * factor, savers)]
    return out


def size(n: float) -> str:
    """Bytes as GiB, or MiB below one GiB (a tiny model's figures would all read 0.0 GiB)."""
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def _describe(world_size: int, new_world: int, sets: dict[str, Any], need: float) -> str:
    keys = " ".join(f"{k}={v}" for k, v in sets.items())
    if new_world != world_size:
        keys = f"{new_world} devices" + (f" with {keys}" if keys else " as configured")
    return f"{keys} ({size(need)}{' each' if new_world != world_size else ''})"


def fitting_layouts(cfg: Config, world_size: int, device_type: str, free: float, kernels: Any = None,
                    limit: int = 4) -> list[str]:
    """Up to `limit` of the nearest layouts whose estimate (plus its margin) fits in `free` bytes per device, one
    per kind (the first that fits of each), each with its estimated peak. More devices are named once: as
    configured, or with the savers when those need fewer."""
    found: list[str] = []
    kinds: set[str] = set()
    for kind, new_world, sets in _candidates(cfg, world_size):
        # one of each kind; more devices once; the savers together only where no single change fits, and more
        # devices with the savers only where the savers do not fit here
        if kind in kinds or "devices" in kinds or (kind == "devices_savers" and "savers" in kinds):
            continue
        variant = _variant(cfg, new_world, sets)
        if variant is None:
            continue
        try:
            need = memory_need(variant, new_world, device_type, kernels, layout_kernels=False)
        except (InternLMCoreError, ValueError):
            continue
        if need * (1 + ESTIMATE_MARGIN) <= free:
            kinds.add(kind)
            if kind != "savers" or len(found) == 0:
                found.append(_describe(world_size, new_world, sets, need))
        if len(found) >= limit:
            break
    return found


def _gather(mine: RankMemory, world_size: int, distributed: bool) -> list[RankMemory]:
    """Every rank's figures (one all-gather of small objects)."""
    ranks = [mine]
    if distributed:
        box: list[Any] = [None] * world_size
        collectives.all_gather_object(box, mine)
        ranks = list(box)
    return ranks


def check_memory(cfg: Config, world_size: int, rank: int, device: torch.device, distributed: bool,
                 kernels: Any = None, pipeline_rank: Optional[int] = None) -> Optional[RankMemory]:
    """Refuse (ConfigError, on every rank) a run whose estimate exceeds the memory free for a rank by more than the
    estimator's error; warn near the limit; `cfg.memory_check` "warn" only warns, "off" skips. Returns the worst
    rank's figures (None when skipped)."""
    mode = cfg.memory_check
    if mode not in MEMORY_CHECKS:
        raise ConfigError(f"memory_check: expected one of {', '.join(MEMORY_CHECKS)}, got {mode!r}")
    if cfg.memory_limit_gib is not None and not cfg.memory_limit_gib > 0:
        raise ConfigError(f"memory_limit_gib: expected a positive number of GiB or None, got {cfg.memory_limit_gib!r}")
    if mode == "off" or device.type not in ("cpu", "cuda"):
        return None
    device_type = device.type
    try:
        need = memory_need(cfg, world_size, device_type, kernels, pipeline_rank)
    except (InternLMCoreError, ValueError) as e:  # a family without counts: the run is not the estimator's to stop
        logger.warning(f"memory check skipped: the estimator cannot size this run ({e})")
        need = 0.0
    free, source = free_memory(device, cfg.memory_limit_gib)
    shared = device_type == "cpu" and cfg.memory_limit_gib is None
    ranks = _gather(RankMemory(rank, socket.gethostname(), need, free, source, shared), world_size, distributed)
    for r in ranks:  # the ranks of one host share its RAM: each gets its part
        local = sum(1 for o in ranks if o.host == r.host and o.shared)
        if r.shared and local > 1:
            r.free, r.source = r.free / local, f"{r.source} {size(r.free)} / {local} ranks on {r.host}"
    worst = max(ranks, key=lambda r: r.need / max(r.free, 1.0))
    verdict = worst.verdict
    where = f"rank {worst.rank}" if len(ranks) > 1 else "this process"
    if verdict == "fits":
        if rank == 0:
            logger.info(f"memory: the estimator puts {where} at {size(worst.need)} per device, {size(worst.free)} "
                        f"is free ({worst.source})")
        return worst
    layouts = fitting_layouts(cfg, world_size, device_type, worst.free, kernels)
    head = (f"memory: the estimator puts {where} at {size(worst.need)} per device ({device_type}, "
            f"+/-{ESTIMATE_MARGIN:.0%}) but {size(worst.free)} is free ({worst.source}); ")
    fits = ("layouts that fit: " + "; ".join(layouts)) if layouts else "no layout tried fits (up to 1024x the devices)"
    if verdict == "over" and mode == "refuse":
        raise ConfigError(head + fits + '; train.py --force or memory_check="warn" runs anyway, memory_check="off" '
                                        "skips this check, memory_limit_gib sets the free figure")
    if rank == 0:
        logger.warning(head + ("within the estimator's error: it may run out of memory" if verdict == "near" else
                               "running anyway (memory_check=\"warn\")") + "; " + fits)
    return worst


def fused_head_chosen(cfg: Config, world_size: int, device: str) -> bool:
    """Whether a run of `cfg` on `world_size` devices of type `device` fuses its head: model.fused_head_loss, with
    "auto" decided by the estimator (module docstring)."""
    if cfg.model.fused_head_loss != "auto":
        return fused_head_of(cfg)
    try:
        return estimate(cfg, world_size, device=device).cross_entropy == "fused_head"
    except (InternLMCoreError, ValueError) as e:  # a family without counts: nothing to decide by, the plain head
        logger.info(f"model.fused_head_loss=\"auto\": unfused head (the estimator cannot size this run: {e})")
        return False
