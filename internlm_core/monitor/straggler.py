"""Straggler diagnosis, after InternLM's `empty_cache_and_diag`: gather step times, name the slow ranks.

    diag = build_straggler_monitor(cfg.data, rank)   # None when data.empty_cache_and_diag_interval <= 0
    callbacks.add(diag)

Every `interval` steps each rank contributes the mean wall time of its steps since the last check
(measured between `on_step_end` calls, so data wait, compute and communication all count); the times
and host names are all-gathered (gloo or NCCL; a single process without a group just reports itself),
and ranks slower than `outlier_ratio` × the mean are reported with their host, as a warning on rank 0.
All ranks must run the check at the same steps (they do: it is keyed on the step number). When the
training `device` is CUDA the allocator cache is emptied after the check, as InternLM does.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from internlm_core.trainer.callbacks import TrainerCallback
from internlm_core.utils.logging import get_logger

from ._dist import dist_ready

logger = get_logger(__name__)


@dataclass
class Straggler:
    rank: int
    host: str
    step_time: float
    ratio: float  # step_time / mean


@dataclass
class StragglerReport:
    step: Optional[int]
    step_times: list[float]
    hosts: list[str]
    mean: float
    outlier_ratio: float
    stragglers: list[Straggler] = field(default_factory=list)

    def format(self) -> str:
        at = f"step {self.step}: " if self.step is not None else ""
        if not self.stragglers:
            return (f"{at}no straggler among {len(self.step_times)} rank(s); mean step time {self.mean:.3f} s, "
                    f"slowest {max(self.step_times):.3f} s")
        slow = ", ".join(f"rank {s.rank} ({s.host}) {s.step_time:.3f} s = {s.ratio:.2f}x" for s in self.stragglers)
        return (f"{at}{len(self.stragglers)} straggler(s) slower than {self.outlier_ratio:g}x the mean step time "
                f"{self.mean:.3f} s: {slow}")


def diagnose_stragglers(step_time: float, outlier_ratio: float, step: Optional[int] = None,
                        group: Optional[dist.ProcessGroup] = None) -> StragglerReport:
    """All-gather this rank's `step_time` (seconds) and host over `group`; every rank gets the same report.

    A collective: every rank of `group` must call it. Without a process group it reports this process alone.
    """
    host = socket.gethostname()
    if dist_ready():
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (float(step_time), host), group=group)
        times = [float(t) for t, _ in gathered]
        hosts = [str(h) for _, h in gathered]
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(times)))
    else:
        times, hosts, ranks = [float(step_time)], [host], [0]
    mean = sum(times) / len(times)
    stragglers = [Straggler(rank=r, host=h, step_time=t, ratio=t / mean)
                  for r, h, t in zip(ranks, hosts, times) if mean > 0 and t > outlier_ratio * mean]
    return StragglerReport(step=step, step_times=times, hosts=hosts, mean=mean, outlier_ratio=outlier_ratio,
                           stragglers=stragglers)


class StragglerMonitor(TrainerCallback):
    """Runs `diagnose_stragglers` every `interval` steps on the mean step time since the last check."""

    def __init__(self, interval: int, outlier_ratio: float = 1.1, rank: int = 0,
                 group: Optional[dist.ProcessGroup] = None, device: Optional[torch.device] = None):
        if interval <= 0:
            raise ValueError(f"straggler check interval: expected > 0 steps, got {interval}")
        self.interval = int(interval)
        self.outlier_ratio = float(outlier_ratio)
        self.rank = rank
        self.group = group
        self.device = torch.device(device) if device is not None else None
        self.last_report: Optional[StragglerReport] = None
        self._t_last: Optional[float] = None
        self._elapsed = 0.0
        self._count = 0

    def on_train_start(self, trainer: Any) -> None:
        self._t_last = time.perf_counter()

    def on_step_end(self, trainer: Any, metrics: dict) -> None:
        now = time.perf_counter()
        if self._t_last is not None:
            self._elapsed += now - self._t_last
            self._count += 1
        self._t_last = now
        step = int(metrics["step"])
        if step % self.interval or self._count == 0:
            return
        report = diagnose_stragglers(self._elapsed / self._count, self.outlier_ratio, step=step, group=self.group)
        self.last_report = report
        self._elapsed, self._count = 0.0, 0
        if self.rank == 0:
            (logger.warning if report.stragglers else logger.info)("straggler check: %s", report.format())
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._t_last = time.perf_counter()  # the check itself is not a step


def build_straggler_monitor(data_cfg: Any, rank: int = 0, group: Optional[dist.ProcessGroup] = None,
                            device: Optional[torch.device] = None) -> Optional[StragglerMonitor]:
    """From `cfg.data.empty_cache_and_diag_interval` and `cfg.data.diag_outlier_ratio`; None when the interval <= 0."""
    interval = int(getattr(data_cfg, "empty_cache_and_diag_interval", 0) or 0)
    if interval <= 0:
        return None
    return StragglerMonitor(interval, getattr(data_cfg, "diag_outlier_ratio", 1.1), rank=rank, group=group,
                            device=device)
