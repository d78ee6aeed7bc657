"""`train.py --simulate W [--simulate-rank R] [--simulate-device cuda]`: run a config as rank R of a W-rank job on
this machine's CPU (or its GPU).

The fake process group (distributed/simulate.py) makes every collective return at once, so the rank builds,
shards and trains exactly its own part of the job: real per-rank shapes, memory and compute. The run folder
gets the usual metrics and memory report; the summary compares the peak with the estimator's prediction for
the same layout on the same device type (`tools/estimate.py --device cpu` / gpu, with the attention kernel the
run chose). Validation is skipped; on a CPU glibc returns freed memory at once, so that the peak resident memory
follows the live tensors as a GPU allocator's peak does; on a GPU the peak is the CUDA allocator's (allocated, and
reserved beside it).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import psutil
import torch
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


def check_fits(cfg: Config, world_size: int, rank: int, available: Optional[int] = None,
               device_type: str = "cpu") -> float:
    """The estimator's peak bytes of the busiest rank on `device_type`, beyond what the process holds already;
    LaunchError when that exceeds this machine's free memory (the GPU's, on "cuda")."""
    need = estimate(cfg, world_size, device=device_type).memory.total
    if available is None:
        available = torch.cuda.mem_get_info()[0] if device_type == "cuda" else psutil.virtual_memory().available
    if need > 0.9 * available:
        raise LaunchError(f"--simulate {world_size}: rank {rank}'s share needs about {need / GiB:.1f} GiB "
                          f"(tools/estimate.py --device {'gpu' if device_type == 'cuda' else 'cpu'}) but this "
                          f"{'GPU' if device_type == 'cuda' else 'machine'} has {available / GiB:.1f} GiB free; "
                          f"simulate a larger world size, a smaller micro-batch or activation checkpointing")
    return need


def simulate(cfg: Config, world_size: int, rank: int, run_dir: Path, seed: Optional[int] = None,
             device_type: str = "cpu") -> dict:
    """Train `cfg` for `data.total_steps` steps as rank `rank` of `world_size` on `device_type`; returns (and
    prints) the summary."""
    cuda = device_type == "cuda"
    # a CPU run's peak counts the process, as its estimate then does; the CUDA allocator counts tensors only
    runtime = 0 if cuda else process_before_model()
    check_fits(cfg, world_size, rank, device_type=device_type)
    cfg.ckpt.enable_save_ckpt = False  # nothing to save: the other ranks' shards do not exist
    cfg.ckpt.auto_resume = False
    cfg.ckpt.load_ckpt_info = None
    cfg.monitor.memory_report = True
    if not cuda and track_live_cpu_memory():  # before the build: the peak RSS then follows live tensors
        logger.info("CPU allocator: freed memory goes back to the OS at once (the peak follows live tensors)")
    launch = init_simulated(world_size, rank, device_type=device_type)
    trainer = build_trainer(cfg, launch, run_dir, seed=seed)
    # the estimator's figures for this rank's pipeline stage (check_fits took the busiest), its kernels
    predicted_est = estimate(cfg, world_size, device=device_type, pipeline_rank=trainer.dims.pp_rank,
                             runtime_bytes=runtime, attention=trainer.kernels.attention)
    predicted, comm_predicted = predicted_est.memory.total, predicted_est.communication
    trainer.train()
    for module in trainer.model.modules():  # a pipeline stage may still hold its gathered weights: count shards
        if isinstance(module, FSDPModule):
            module.reshard()
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in trainer.model.parameters())
    memory = next(cb for cb in trainer.callbacks.callbacks if type(cb).__name__ == "MemoryProfiler")
    peak = int(memory.peak_record["peak_bytes"]) if memory.peak_record else 0
    reserved = memory.peak_record.get("peak_reserved_bytes") if memory.peak_record else None
    summary = {"world_size": world_size, "rank": rank, "device": str(launch.device), "layout": trainer.dims.describe(),
               "attention": trainer.kernels.attention, "cross_entropy": trainer.kernels.cross_entropy,
               "parameters_held": held, "peak_bytes": peak, "peak_reserved_bytes": reserved,
               "estimated_bytes": int(predicted),
               "peak_over_estimate": peak / predicted if predicted else None,
               "estimated_gib": {k: getattr(predicted_est.memory, k) / GiB for k in predicted_est.memory.ORDER},
               "steps": trainer.state.batch_count,
               # FSDP's collectives in the last step (parallel.CommCounter) and the estimator's figures
               "comm": {k: v for k, v in trainer.last_metrics.items() if k.startswith("comm/")},
               "comm_estimated": dataclasses.asdict(comm_predicted)}
    (run_dir / "simulate.json").write_text(json.dumps(summary, indent=1))
    where = f"this GPU ({launch.device})" if cuda else "this CPU"
    reserved_note = f", reserved {reserved / GiB:.2f} GiB" if reserved is not None else ""
    print(f"simulated rank {rank} of {world_size} ({summary['layout']}), {summary['steps']} steps on {where}:\n"
          f"  parameters held   {held:,}\n"
          f"  peak memory       {peak / GiB:.2f} GiB{reserved_note} (memory_report.json)\n"
          f"  {'estimator (' + device_type + ')':<18}{predicted / GiB:.2f} GiB (pipeline stage {trainer.dims.pp_rank}: "
          f"{predicted_est.memory.stage}; of it {runtime / GiB:.2f} GiB the process before the model)\n"
          f"  peak / estimate   {summary['peak_over_estimate']:.2f}")
    if summary["comm"]:
        c = summary["comm"]
        print(f"  FSDP per step     {c['comm/gathered_bytes'] / GiB:.2f} GiB gathered ({c['comm/gathers']} all-gathers), "
              f"{c['comm/reduced_bytes'] / GiB:.2f} GiB reduced ({c['comm/reduces']} reduce-scatters); estimator "
              f"{comm_predicted.gathered_bytes / GiB:.2f} / {comm_predicted.reduced_bytes / GiB:.2f} GiB")
    return summary
