"""The memory report: peak memory per step and its breakdown (an observer of the trainer's loop).

    mem = MemoryProfiler(run_dir, rank, device)    # when cfg.monitor.memory_report or --profiling
    callbacks.add(mem)                             # takes view.model / view.optimizer at train start

Peak per step
    CUDA: `torch.cuda.max_memory_allocated` since the previous step end (the allocator's peak is reset
    after each reading); `max_memory_reserved` is reported alongside.
    CPU: the process's peak resident set size (VmHWM in /proc/self/status) since the previous step
    end; the kernel's high-water mark is reset by writing 5 to /proc/self/clear_refs. Where that is not
    possible, the lifetime peak (`ru_maxrss`) is used instead, and the report says so.

Breakdown (of the step with the highest peak)
    parameters, gradients, optimizer state: sums of tensor bytes on this rank (a DTensor counts its
    local shard; tensors sharing storage count once). Gradients are measured from `param.grad`; if the
    trainer has already freed them when the step ends, they are estimated as the bytes of the trainable
    parameters (same shapes and dtypes) and the report says "estimated".
    accumulated gradients: when FSDP reduces gradients once per step (numerics' Kernels.grad_reduce "step",
    e.g. under pipeline parallel) with sharded data parallel, it keeps every parameter's gradient unsharded
    from the first micro-batch to the last: the bytes beyond the shard, (dp_shard - 1) x the local gradients.
    activations (estimate) = peak - overhead - parameters - gradients - accumulated gradients - optimizer
    state: whatever else the step held at its peak (activations kept for backward, temporaries, buffers).
    overhead: CUDA 0 (the allocator counts tensors only); CPU the resident memory at train start not
    held by those tensors (interpreter, libraries, data loader), measured once at train start.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from ..callbacks import StepView, TrainerCallback
from ..utils.logging import get_logger
from ..utils.memory import (fmt_bytes, gradient_bytes, local_tensor, optimizer_state_bytes, parameter_bytes,
                            process_peak_rss, process_rss, reset_peak_rss, trainable_parameter_bytes)

logger = get_logger(__name__)


class MemoryProfiler(TrainerCallback):
    """Peak memory per step and its breakdown; writes `memory_report.json` and `memory_report.txt`.

    Args:
        run_dir: where the report goes (rank 0: memory_report.*, others memory_report_rank{N}.*).
        rank: this process's rank.
        device: the training device (default: the device of the model's first parameter).
        model, optimizer: default `view.model` / `view.optimizer` at train start.
        write_every: also write the report every this many steps (0: only at train end), so a run
            that crashes still leaves one.
        keep_steps: per-step records kept in the report (the first 10 and the last `keep_steps`).
    """

    def __init__(self, run_dir: str | Path, rank: int = 0, device: Optional[torch.device] = None,
                 model: Optional[torch.nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 write_every: int = 50, keep_steps: int = 100, accumulated: int = 0):
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.device = torch.device(device) if device is not None else None
        self.model = model
        self.optimizer = optimizer
        self.write_every = write_every
        self.first_steps: list[dict] = []
        self.last_steps: deque = deque(maxlen=keep_steps)
        self.peak_record: Optional[dict] = None
        self.overhead = 0
        self.accumulated = accumulated  # unsharded gradients kept between micro-batches (see the module docstring)
        self.peak_method = ""
        self._can_reset_rss = False

    @property
    def stem(self) -> str:
        return "memory_report" if self.rank == 0 else f"memory_report_rank{self.rank}"

    def _is_cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def start(self, model: Optional[torch.nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        self.model = model if model is not None else self.model
        self.optimizer = optimizer if optimizer is not None else self.optimizer
        if self.device is None and self.model is not None:
            first = next(self.model.parameters(), None)
            self.device = local_tensor(first).device if first is not None else torch.device("cpu")
        if self.device is None:
            self.device = torch.device("cpu")
        if self._is_cuda():
            torch.cuda.reset_peak_memory_stats(self.device)
            self.overhead = 0
            self.peak_method = "torch.cuda.max_memory_allocated since the previous step end"
        else:
            held = self._persistent()
            self.overhead = max(0, process_rss() - held["parameters"] - held["gradients_measured"]
                                - held["optimizer_state"])
            self._can_reset_rss = reset_peak_rss()
            self.peak_method = ("process peak RSS (VmHWM) since the previous step end" if self._can_reset_rss
                                else "process peak RSS over the whole run (ru_maxrss/VmHWM; cannot reset per step)")

    def _persistent(self) -> dict:
        params = parameter_bytes(self.model) if self.model is not None else 0
        grads = gradient_bytes(self.model) if self.model is not None else 0
        return {"parameters": params, "gradients_measured": grads,
                "optimizer_state": optimizer_state_bytes(self.optimizer)}

    def measure(self, step: int) -> dict:
        """Read the peak since the previous call and break it down; resets the peak for the next step."""
        if self._is_cuda():
            peak = int(torch.cuda.max_memory_allocated(self.device))
            reserved = int(torch.cuda.max_memory_reserved(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            peak = process_peak_rss()
            reserved = None
            if self._can_reset_rss:
                reset_peak_rss()
        held = self._persistent()
        grads = held["gradients_measured"]
        grads_method = "measured"
        if grads == 0 and self.model is not None:
            grads = trainable_parameter_bytes(self.model)
            grads_method = "estimated (freed at step end; bytes of the trainable parameters)"
        activations = max(0, peak - self.overhead - held["parameters"] - grads - self.accumulated
                          - held["optimizer_state"])
        rec = {"step": step, "peak_bytes": peak, "parameters": held["parameters"], "gradients": grads,
               "gradients_method": grads_method, "accumulated_gradients": self.accumulated,
               "optimizer_state": held["optimizer_state"],
               "activations_estimate": activations, "overhead": self.overhead}
        if reserved is not None:
            rec["peak_reserved_bytes"] = reserved
        if len(self.first_steps) < 10:
            self.first_steps.append(rec)
        else:
            self.last_steps.append(rec)
        if self.peak_record is None or peak >= self.peak_record["peak_bytes"]:
            self.peak_record = rec
        return rec

    def report(self) -> dict:
        return {
            "rank": self.rank,
            "device": str(self.device),
            "peak_method": self.peak_method,
            "activations_method": "peak - overhead - parameters - gradients - accumulated_gradients - optimizer_state",
            "overhead_method": ("0: the CUDA allocator counts tensors only" if self._is_cuda() else
                                "resident memory at train start not held by parameters/gradients/optimizer state"),
            "peak": self.peak_record,
            "steps": self.first_steps + list(self.last_steps),
        }

    def write(self) -> tuple[Path, Path]:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        rep = self.report()
        json_path = self.run_dir / f"{self.stem}.json"
        json_path.write_text(json.dumps(rep, indent=2) + "\n", encoding="utf-8")
        txt_path = self.run_dir / f"{self.stem}.txt"
        txt_path.write_text(self.format(rep), encoding="utf-8")
        return json_path, txt_path

    @staticmethod
    def format(rep: dict) -> str:
        p = rep["peak"]
        lines = [f"memory report: rank {rep['rank']}, device {rep['device']}", f"peak per step: {rep['peak_method']}"]
        if p is None:
            return "\n".join(lines + ["no step measured"]) + "\n"
        lines += [
            "",
            f"highest peak: {fmt_bytes(p['peak_bytes'])} at step {p['step']}"
            + (f" (reserved {fmt_bytes(p['peak_reserved_bytes'])})" if "peak_reserved_bytes" in p else ""),
            f"  parameters        {fmt_bytes(p['parameters']):>12}",
            f"  gradients         {fmt_bytes(p['gradients']):>12}   {p['gradients_method']}",
            f"  accumulated grads {fmt_bytes(p.get('accumulated_gradients', 0)):>12}   unsharded between micro-batches",
            f"  optimizer state   {fmt_bytes(p['optimizer_state']):>12}",
            f"  activations (est) {fmt_bytes(p['activations_estimate']):>12}   {rep['activations_method']}",
            f"  overhead          {fmt_bytes(p['overhead']):>12}   {rep['overhead_method']}",
            "",
            f"{'step':>8} {'peak':>12} {'activations':>12}",
        ]
        lines += [f"{r['step']:>8} {fmt_bytes(r['peak_bytes']):>12} {fmt_bytes(r['activations_estimate']):>12}"
                  for r in rep["steps"]]
        return "\n".join(lines) + "\n"

    # -- trainer callback ------------------------------------------------------------------------------
    def on_train_start(self, view: StepView) -> None:
        self.start(self.model if self.model is not None else view.model,
                   self.optimizer if self.optimizer is not None else view.optimizer)

    def on_step_end(self, view: StepView, metrics: Mapping[str, Any]) -> None:
        step = int(metrics["step"])
        self.measure(step)
        if self.write_every > 0 and (len(self.first_steps) == 1 or step % self.write_every == 0):
            self.write()

    def on_train_end(self, view: StepView) -> None:
        if self.peak_record is not None:
            json_path, _ = self.write()
            p = self.peak_record
            logger.info("memory: peak %s at step %d (parameters %s, gradients %s, optimizer state %s, "
                        "activations ~%s); report %s", fmt_bytes(p["peak_bytes"]), p["step"], fmt_bytes(p["parameters"]),
                        fmt_bytes(p["gradients"]), fmt_bytes(p["optimizer_state"]), fmt_bytes(p["activations_estimate"]),
                        json_path)
