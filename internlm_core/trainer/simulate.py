"""`train.py --simulate W [--simulate-rank R]`: run a config as rank R of a W-rank job on this machine's CPU.

The fake process group (distributed/simulate.py) makes every collective return at once, so the rank builds,
shards and trains exactly its own part of the job: real per-rank shapes, memory and compute. The run folder
gets the usual metrics and memory report; the summary compares the peak with the estimator's prediction for
the same layout on CPU (`tools/estimate.py --device cpu`). Validation is skipped, and glibc returns freed memory
at once, so that the peak resident memory follows the live tensors as a GPU allocator's peak does.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import psutil
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ..config import Config
from ..distributed import init_simulated
from ..errors import LaunchError
from ..estimate import GiB, estimate
from ..utils.logging import get_logger
from ..utils.memory import process_rss, track_live_cpu_memory
from .build import build_trainer

logger = get_logger(__name__)


def process_before_model() -> int:
    """Resident bytes of this process with the modules a training run loads, before any model exists: what the
    peak of a CPU run counts beyond the tensors the estimator adds up (`estimate(runtime_bytes=...)`)."""
    from ..parallel import fsdp, pipeline  # noqa: F401  (FSDP2, DTensor and pipelining load here, lazily)

    return process_rss()


def check_fits(cfg: Config, world_size: int, rank: int, available: Optional[int] = None) -> float:
    """The estimator's peak bytes of the busiest rank on CPU, beyond what the process holds already; LaunchError
    when that exceeds this machine's free memory."""
    need = estimate(cfg, world_size, device="cpu").memory.total
    available = psutil.virtual_memory().available if available is None else available
    if need > 0.9 * available:
        raise LaunchError(f"--simulate {world_size}: rank {rank}'s share needs about {need / GiB:.1f} GiB "
                          f"(tools/estimate.py --device cpu) but this machine has {available / GiB:.1f} GiB free; "
                          f"simulate a larger world size, a smaller micro-batch or activation checkpointing")
    return need


def simulate(cfg: Config, world_size: int, rank: int, run_dir: Path, seed: Optional[int] = None) -> dict:
    """Train `cfg` for `data.total_steps` steps as rank `rank` of `world_size`; returns (and prints) the summary."""
    runtime = process_before_model()  # the estimate of this rank counts the process, as its peak does
    check_fits(cfg, world_size, rank)
    cfg.ckpt.enable_save_ckpt = False  # nothing to save: the other ranks' shards do not exist
    cfg.ckpt.auto_resume = False
    cfg.ckpt.load_ckpt_info = None
    cfg.monitor.memory_report = True
    if track_live_cpu_memory():  # before the build: the peak RSS then follows live tensors, as on a GPU
        logger.info("CPU allocator: freed memory goes back to the OS at once (the peak follows live tensors)")
    launch = init_simulated(world_size, rank)
    trainer = build_trainer(cfg, launch, run_dir, seed=seed)
    # the estimator's figures for this rank's pipeline stage (check_fits took the busiest)
    predicted_est = estimate(cfg, world_size, device="cpu", pipeline_rank=trainer.dims.pp_rank,
                             runtime_bytes=runtime)
    predicted, comm_predicted = predicted_est.memory.total, predicted_est.communication
    trainer.train()
    for module in trainer.model.modules():  # a pipeline stage may still hold its gathered weights: count shards
        if isinstance(module, FSDPModule):
            module.reshard()
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in trainer.model.parameters())
    memory = next(cb for cb in trainer.callbacks.callbacks if type(cb).__name__ == "MemoryProfiler")
    peak = int(memory.peak_record["peak_bytes"]) if memory.peak_record else 0
    summary = {"world_size": world_size, "rank": rank, "layout": trainer.dims.describe(),
               "parameters_held": held, "peak_bytes": peak, "estimated_bytes": int(predicted),
               "peak_over_estimate": peak / predicted if predicted else None,
               "estimated_gib": {k: getattr(predicted_est.memory, k) / GiB for k in predicted_est.memory.ORDER},
               "steps": trainer.state.batch_count,
               # FSDP's collectives in the last step (parallel.CommCounter) and the estimator's figures
               "comm": {k: v for k, v in trainer.last_metrics.items() if k.startswith("comm/")},
               "comm_estimated": dataclasses.asdict(comm_predicted)}
    (run_dir / "simulate.json").write_text(json.dumps(summary, indent=1))
    print(f"simulated rank {rank} of {world_size} ({summary['layout']}), {summary['steps']} steps on this CPU:\n"
          f"  parameters held   {held:,}\n"
          f"  peak memory       {peak / GiB:.2f} GiB (memory_report.json)\n"
          f"  estimator (cpu)   {predicted / GiB:.2f} GiB (pipeline stage {trainer.dims.pp_rank}: "
          f"{predicted_est.memory.stage}; of it {runtime / GiB:.2f} GiB the process before the model)\n"
          f"  peak / estimate   {summary['peak_over_estimate']:.2f}")
    if summary["comm"]:
        c = summary["comm"]
        print(f"  FSDP per step     {c['comm/gathered_bytes'] / GiB:.2f} GiB gathered ({c['comm/gathers']} all-gathers), "
              f"{c['comm/reduced_bytes'] / GiB:.2f} GiB reduced ({c['comm/reduces']} reduce-scatters); estimator "
              f"{comm_predicted.gathered_bytes / GiB:.2f} / {comm_predicted.reduced_bytes / GiB:.2f} GiB")
    return summary
