"""`torch.profiler` on a schedule, on chosen ranks only (InternLM's `initialize_llm_profile`).

    prof = build_profiler(run_dir, rank, enabled=args.profiling,
                          dp_rank=dims.dp_rank, tp_rank=dims.tp_rank, device=device)   # None elsewhere
    if prof: callbacks.add(prof)    # start at train start, step() at each step end, stop at train end

Traces go to `run_dir/profile/rank{N}.<id>.pt.trace.json` through `tensorboard_trace_handler`: open them
in TensorBoard (torch-tb-profiler) or drop the JSON onto https://ui.perfetto.dev. The schedule is torch's:
`skip_first` steps ignored, then cycles of `wait` idle, `warmup` (profiling, discarded) and `active`
(recorded) steps, `repeat` cycles (0: until the end). A run must last at least
skip_first + wait + warmup + active steps for one trace; stopping inside an active window still writes it.
By default only data-parallel rank 0 with tensor rank 0 profiles (one process per pipeline stage), as InternLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from ..callbacks import StepView, TrainerCallback
from ..utils.logging import get_logger

logger = get_logger(__name__)


def is_profiling_rank(dp_rank: int = 0, tp_rank: int = 0) -> bool:
    """InternLM's choice: data-parallel rank 0 and tensor rank 0 (every pipeline stage once)."""
    return dp_rank == 0 and tp_rank == 0


class TorchProfiler(TrainerCallback):
    """A `torch.profiler.profile` driven by the step loop; writes traces into `out_dir`."""

    def __init__(self, out_dir: str | Path, rank: int = 0, device: Optional[torch.device] = None,
                 skip_first: int = 0, wait: int = 1, warmup: int = 1, active: int = 3, repeat: int = 1,
                 record_shapes: bool = True, profile_memory: bool = True, with_stack: bool = False):
        self.out_dir = Path(out_dir)
        self.rank = rank
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.schedule = schedule(skip_first=skip_first, wait=wait, warmup=warmup, active=active, repeat=repeat)
        self.options = dict(record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack)
        self._prof: Optional[profile] = None

    def start(self) -> None:
        if self._prof is not None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._prof = profile(activities=self.activities, schedule=self.schedule,
                             on_trace_ready=tensorboard_trace_handler(str(self.out_dir), worker_name=f"rank{self.rank}"),
                             **self.options)
        self._prof.start()
        logger.info("profiling on rank %d; traces go to %s", self.rank, self.out_dir)

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def stop(self) -> None:
        if self._prof is not None:
            self._prof.stop()
            self._prof = None

    def traces(self) -> list[Path]:
        return sorted(self.out_dir.glob("*.pt.trace.json*"))

    def __enter__(self) -> "TorchProfiler":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def on_train_start(self, view: StepView) -> None:
        self.start()

    def on_step_end(self, view: StepView, metrics: Mapping[str, Any]) -> None:
        self.step()

    def on_train_end(self, view: StepView) -> None:
        self.stop()


def build_profiler(run_dir: str | Path, rank: int = 0, enabled: bool = False, dp_rank: int = 0, tp_rank: int = 0,
                   device: Optional[torch.device] = None, **schedule_kwargs: Any) -> Optional[TorchProfiler]:
    """A TorchProfiler writing into `run_dir/profile` when `enabled` and this is a profiling rank, else None."""
    if not enabled or not is_profiling_rank(dp_rank, tp_rank):
        return None
    return TorchProfiler(Path(run_dir) / "profile", rank=rank, device=device, **schedule_kwargs)
