"""Straggler diagnosis, after InternLM's `empty_cache_and_diag`: gather per-rank times, name the slow ranks.

    diag = build_straggler_monitor(cfg.data, rank, device=trainer.device)
    if diag: callbacks.add(diag)    # None when data.empty_cache_and_diag_interval <= 0

Why not the wall time of a step: in synchronous training every rank waits for the slowest one in its
collectives, so wall step times are the same on all ranks and name nobody. What differs per rank is
the time spent *outside* waits. Every `interval` steps the monitor gathers, per rank:

* each of `time_keys` the metrics record carries (default the trainer's per-rank timers `time/data`,
  `time/fwd`, `time/cal_loss`, `time/bwd`), summed over the window. `time/data` is purely local (a slow
  file system on one host stands out); forward and backward also contain waits in FSDP/DDP collectives,
  which even out the ranks, so a slow device shows best in `bench`;
* `bench`: the time of a fixed local matrix-multiply benchmark on the training device (as InternLM's
  `bench_gpu`), which finds a slow or throttled device whatever the parallel layout; no collective inside;
* `step_time`: the mean wall time between step ends, only when neither of the above is available
  (useful without synchronizing collectives).

All are gathered in one `all_gather_object` (gloo or NCCL; a single process reports itself), and a rank
whose time exceeds `outlier_ratio` × the mean of that measure is reported with its host, as a warning on
rank 0. Every rank runs the check at the same steps (keyed on the step number). On a CUDA device InternLM empties
the allocator cache after every check; here only where fragmentation is shown (`cache_is_fragmented`: the cache
holds more than FRAGMENTED_BYTES and FRAGMENTED_FRACTION of itself beyond the live tensors), since emptying a cache
the next step fills again costs a free and a new allocation of every cached segment (device synchronizations) on
every rank. With PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the SLURM templates set it) segments grow and
shrink in place and the idle part stays small.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist

from internlm_core.callbacks import StepView, TrainerCallback
from internlm_core.utils import collectives
from internlm_core.utils.logging import get_logger


logger = get_logger(__name__)

DEFAULT_TIME_KEYS = ("time/data", "time/fwd", "time/cal_loss", "time/bwd", "time/fwd_bwd")


@dataclass
class Straggler:
    rank: int
    host: str
    measure: str
    seconds: float
    ratio: float  # seconds / mean of the measure


@dataclass
class StragglerReport:
    step: Optional[int]
    outlier_ratio: float
    ranks: list[int]
    hosts: list[str]
    # measure -> seconds per rank (in `ranks` order); None where a rank does not time that phase (under
    # pipeline parallel only the last stage computes the loss)
    times: dict[str, list[Optional[float]]]
    stragglers: list[Straggler] = field(default_factory=list)

    def values(self, measure: str) -> list[float]:
        return [v for v in self.times[measure] if v is not None]

    def mean(self, measure: str) -> float:
        values = self.values(measure)
        return sum(values) / len(values)

    def format(self) -> str:
        at = f"step {self.step}: " if self.step is not None else ""
        means = ", ".join(f"{m} mean {self.mean(m):.4f} s max {max(self.values(m)):.4f} s" for m in self.times)
        if not self.stragglers:
            return f"{at}no straggler among {len(self.ranks)} rank(s) ({means})"
        slow = "; ".join(f"rank {s.rank} ({s.host}) {s.measure} {s.seconds:.4f} s = {s.ratio:.2f}x the mean"
                         for s in self.stragglers)
        return f"{at}{len(self.stragglers)} straggler(s) slower than {self.outlier_ratio:g}x the mean: {slow} ({means})"


def diagnose_stragglers(times: Union[float, Mapping[str, float]], outlier_ratio: float, step: Optional[int] = None,
                        group: Optional[dist.ProcessGroup] = None) -> StragglerReport:
    """All-gather this rank's times (seconds; a float means {"step_time": t}) and host; same report on every rank.

    A collective: every rank of `group` must call it. Ranks may time different phases (a pipeline stage
    without the loss has no `time/cal_loss`): each measure is compared among the ranks that have it.
    Without a process group it reports this process alone.
    """
    mine = {"step_time": float(times)} if isinstance(times, (int, float)) else {k: float(v) for k, v in times.items()}
    host = socket.gethostname()
    if collectives.dist_ready():
        gathered: list[Any] = [None] * dist.get_world_size(group)
        collectives.all_gather_object(gathered, (mine, host), group=group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(gathered)))
    else:
        gathered, ranks = [(mine, host)], [0]
    hosts = [h for _, h in gathered]
    names = list(dict.fromkeys(m for t, _ in gathered for m in t))  # every rank's measures, first seen first
    per_measure = {m: [float(t[m]) if m in t else None for t, _ in gathered] for m in names}
    report = StragglerReport(step=step, outlier_ratio=outlier_ratio, ranks=ranks, hosts=hosts, times=per_measure)
    for m, values in per_measure.items():
        mean = report.mean(m)
        for r, h, v in zip(ranks, hosts, values):
            if v is not None and mean > 0 and v > outlier_ratio * mean:
                report.stragglers.append(Straggler(rank=r, host=h, measure=m, seconds=v, ratio=v / mean))
    return report


def device_benchmark(device: Optional[torch.device] = None, size: Optional[int] = None, iters: int = 5) -> float:
    """Seconds for `iters` square matmuls on `device` (bf16 4096 on CUDA, fp32 256 on CPU); purely local."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    cuda = device.type == "cuda"
    n = size or (4096 if cuda else 256)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    b = torch.randn(n, n, device=device, dtype=a.dtype)
    torch.mm(a, b)  # warm-up
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        torch.mm(a, b)
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


# fragmentation shown: the CUDA allocator holds (torch.cuda.memory_reserved - memory_allocated) more than 2 GiB AND
# more than a fifth of what it reserves, in blocks no live tensor uses. Below either, the cached blocks are what the
# next step allocates again (the steady state of a training loop): emptying them would only be paid back in
# cudaMalloc calls. 2 GiB: about one 7B layer's activations at 4K tokens, what a differently shaped micro-batch
# (MoE's varying expert rows) can leave stranded; a fifth: large enough that the cache, not the model, holds it.
FRAGMENTED_BYTES = 2 << 30
FRAGMENTED_FRACTION = 0.2


def cache_is_fragmented(reserved: int, allocated: int, min_bytes: int = FRAGMENTED_BYTES,
                        min_fraction: float = FRAGMENTED_FRACTION) -> bool:
    """True when the allocator's idle bytes (`reserved - allocated`) exceed both `min_bytes` and `min_fraction` of
    `reserved`: the only case in which the straggler check empties the CUDA cache."""
    idle = reserved - allocated
    return idle > min_bytes and idle > min_fraction * reserved


class StragglerMonitor(TrainerCallback):
    """Runs `diagnose_stragglers` every `interval` steps (see the module docstring).

    Args:
        interval: steps between checks (`data.empty_cache_and_diag_interval`).
        outlier_ratio: report ranks above this ratio of the mean (`data.diag_outlier_ratio`).
        rank: this process's global rank (rank 0 logs the report).
        group: process group to compare over (None: all ranks).
        device: the training device (benchmark there; empty a fragmented CUDA cache after a check).
        time_keys: per-rank timer keys of the metrics record, each compared across ranks.
        bench: run the local device benchmark at each check.
    """

    def __init__(self, interval: int, outlier_ratio: float = 1.1, rank: int = 0,
                 group: Optional[dist.ProcessGroup] = None, device: Optional[torch.device] = None,
                 time_keys: Sequence[str] = DEFAULT_TIME_KEYS, bench: bool = True):
        if interval <= 0:
            raise ValueError(f"straggler check interval: expected > 0 steps, got {interval}")
        self.interval = int(interval)
        self.outlier_ratio = float(outlier_ratio)
        self.rank = rank
        self.group = group
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.time_keys = tuple(time_keys)
        self.bench = bench
        self.last_report: Optional[StragglerReport] = None
        self._t_last: Optional[float] = None
        self._wall = 0.0
        self._timed: dict[str, float] = {}
        self._count = 0

    def on_train_start(self, view: StepView) -> None:
        self._t_last = time.perf_counter()

    def on_step_end(self, view: StepView, metrics: Mapping[str, Any]) -> None:
        now = time.perf_counter()
        if self._t_last is not None:
            self._wall += now - self._t_last
        self._t_last = now
        self._count += 1
        for k in self.time_keys:
            if k in metrics:
                self._timed[k] = self._timed.get(k, 0.0) + float(metrics[k])
        step = int(metrics["step"])
        if step % self.interval:
            return
        times: dict[str, float] = dict(self._timed)
        if self.bench:
            times["bench"] = device_benchmark(self.device)
        if not times:
            times["step_time"] = self._wall / self._count
        report = diagnose_stragglers(times, self.outlier_ratio, step=step, group=self.group)
        self.last_report = report
        self._wall, self._timed, self._count = 0.0, {}, 0
        if self.rank == 0:
            (logger.warning if report.stragglers else logger.info)("straggler check: %s", report.format())
        if self.device.type == "cuda":
            self.empty_cache_if_fragmented(step)
        self._t_last = time.perf_counter()  # the check itself is not part of a step

    def empty_cache_if_fragmented(self, step: int) -> bool:
        """torch.cuda.empty_cache() when `cache_is_fragmented` (logged with the figures); True when it did."""
        reserved, allocated = torch.cuda.memory_reserved(self.device), torch.cuda.memory_allocated(self.device)
        if not cache_is_fragmented(reserved, allocated):
            return False
        torch.cuda.empty_cache()
        logger.info("step %d: emptied the CUDA allocator cache (%.2f GiB reserved, %.2f GiB in tensors: over %.1f "
                    "GiB and %.0f%% idle)", step, reserved / 2**30, allocated / 2**30, FRAGMENTED_BYTES / 2**30,
                    FRAGMENTED_FRACTION * 100)
        return True


def build_straggler_monitor(data_cfg: Any, rank: int = 0, group: Optional[dist.ProcessGroup] = None,
                            device: Optional[torch.device] = None, **kwargs: Any) -> Optional[StragglerMonitor]:
    """From `cfg.data.empty_cache_and_diag_interval` and `cfg.data.diag_outlier_ratio`; None when the interval <= 0."""
    interval = int(data_cfg.empty_cache_and_diag_interval or 0)
    if interval <= 0:
        return None
    return StragglerMonitor(interval, data_cfg.diag_outlier_ratio, rank=rank, group=group,
                            device=device, **kwargs)
