"""Memory accounting (tensor bytes of parameters, gradients, optimizer state; peak memory per step) and the
CPU allocator setting the trainer applies (`keep_freed_cpu_memory`).

    mem = MemoryProfiler(run_dir, rank, device)    # when cfg.monitor.memory_report or --profiling
    callbacks.add(mem)                             # takes trainer.model / trainer.optimizer at train start

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
    activations (estimate) = peak - overhead - parameters - gradients - optimizer state: whatever else
    the step held at its peak (activations kept for backward, temporaries, communication buffers).
    overhead: CUDA 0 (the allocator counts tensors only); CPU the resident memory at train start not
    held by those tensors (interpreter, libraries, data loader), measured once at train start.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys
from collections import deque
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from internlm_core.callbacks import TrainerCallback
from internlm_core.utils.logging import get_logger

logger = get_logger(__name__)

MiB = 1024**2


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the local parts of `tensors` (non-tensors are skipped; shared storage counts once)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        t = _local(t)
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if storage.data_ptr() != 0 and key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def parameter_bytes(model: torch.nn.Module) -> int:
    return tensor_bytes(model.parameters())


def gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of the gradients that exist now (0 when they were freed)."""
    return tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)


def trainable_parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes the gradients take when they exist (one per trainable parameter, same shape and dtype)."""
    return tensor_bytes(p for p in model.parameters() if p.requires_grad)


def optimizer_state_bytes(optimizer: Optional[torch.optim.Optimizer]) -> int:
    """Bytes of every tensor in `optimizer.state` (exp_avg, exp_avg_sq, step, ...), DTensors by local shard."""
    if optimizer is None:
        return 0
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values())


# -- process memory (CPU) -------------------------------------------------------------------------------
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> Optional[int]:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def process_rss() -> int:
    """Resident set size of this process in bytes (VmRSS; psutil where /proc is absent)."""
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    import psutil

    return int(psutil.Process().memory_info().rss)


def process_peak_rss() -> int:
    """Peak resident set size in bytes since start or the last `reset_peak_rss` (VmHWM; else ru_maxrss)."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)  # macOS reports bytes, Linux KiB


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux); False where that is not possible."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def _fmt(n: float) -> str:
    n = float(n)
    for unit, size in (("GiB", 1024**3), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


class MemoryProfiler(TrainerCallback):
    """Peak memory per step and its breakdown; writes `memory_report.json` and `memory_report.txt`.

    Args:
        run_dir: where the report goes (rank 0: memory_report.*, others memory_report_rank{N}.*).
        rank: this process's rank.
        device: the training device (default: the device of the model's first parameter).
        model, optimizer: default `trainer.model` / `trainer.optimizer` at train start.
        write_every: also write the report every this many steps (0: only at train end), so a run
            that crashes still leaves one.
        keep_steps: per-step records kept in the report (the first 10 and the last `keep_steps`).
    """

    def __init__(self, run_dir: str | Path, rank: int = 0, device: Optional[torch.device] = None,
                 model: Optional[torch.nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 write_every: int = 50, keep_steps: int = 100):
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
            self.device = _local(first).device if first is not None else torch.device("cpu")
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
        activations = max(0, peak - self.overhead - held["parameters"] - grads - held["optimizer_state"])
        rec = {"step": step, "peak_bytes": peak, "parameters": held["parameters"], "gradients": grads,
               "gradients_method": grads_method, "optimizer_state": held["optimizer_state"],
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
            "activations_method": "peak - overhead - parameters - gradients - optimizer_state",
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
            f"highest peak: {_fmt(p['peak_bytes'])} at step {p['step']}"
            + (f" (reserved {_fmt(p['peak_reserved_bytes'])})" if "peak_reserved_bytes" in p else ""),
            f"  parameters        {_fmt(p['parameters']):>12}",
            f"  gradients         {_fmt(p['gradients']):>12}   {p['gradients_method']}",
            f"  optimizer state   {_fmt(p['optimizer_state']):>12}",
            f"  activations (est) {_fmt(p['activations_estimate']):>12}   {rep['activations_method']}",
            f"  overhead          {_fmt(p['overhead']):>12}   {rep['overhead_method']}",
            "",
            f"{'step':>8} {'peak':>12} {'activations':>12}",
        ]
        lines += [f"{r['step']:>8} {_fmt(r['peak_bytes']):>12} {_fmt(r['activations_estimate']):>12}"
                  for r in rep["steps"]]
        return "\n".join(lines) + "\n"

    # -- trainer callback ------------------------------------------------------------------------------
    def on_train_start(self, trainer: Any) -> None:
        self.start(getattr(trainer, "model", None), getattr(trainer, "optimizer", None))

    def on_step_end(self, trainer: Any, metrics: dict) -> None:
        step = int(metrics["step"])
        self.measure(step)
        if self.write_every > 0 and (len(self.first_steps) == 1 or step % self.write_every == 0):
            self.write()

    def on_train_end(self, trainer: Any) -> None:
        if self.peak_record is not None:
            json_path, _ = self.write()
            p = self.peak_record
            logger.info("memory: peak %s at step %d (parameters %s, gradients %s, optimizer state %s, "
                        "activations ~%s); report %s", _fmt(p["peak_bytes"]), p["step"], _fmt(p["parameters"]),
                        _fmt(p["gradients"]), _fmt(p["optimizer_state"]), _fmt(p["activations_estimate"]),
                        json_path)


def keep_freed_cpu_memory() -> bool:
    """Make glibc keep the memory of freed tensors for the next step instead of returning it to the OS.

    By default glibc maps every block above its mmap threshold (at most 32 MiB) freshly and unmaps it when
    freed, and trims the heap's free top: each training step then faults in and zeroes its large tensors
    (logits, their gradient, activations) again, which on a VM costs as much as a copy of them or more.
    With mmap off and trimming off (M_MMAP_MAX 0, M_TRIM_THRESHOLD 2 GiB), the heap keeps its peak and
    reuses it, as a caching allocator does on GPUs. Not applied when the user set MALLOC_* or
    GLIBC_TUNABLES (their choice wins), or without glibc. Returns whether it was applied.
    """
    if "GLIBC_TUNABLES" in os.environ or any(k.startswith("MALLOC_") for k in os.environ):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))
