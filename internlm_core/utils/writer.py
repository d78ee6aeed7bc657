"""The one metrics writer: `metrics.jsonl` (every step), TensorBoard scalars and the console line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence

from .logging import get_logger
from .redact import redact_tree

logger = get_logger(__name__)

# the order of the console line; other keys follow alphabetically
_CONSOLE_ORDER = ("step", "loss", "mtp_loss", "lr", "grad_norm", "tgs", "tflops", "mfu", "acc", "ppl",
                  "num_consumed_tokens", "inf_nan_skip_batches", "loss_scale", "step_time", "fwd", "bwd")
_CONSOLE_SKIP_PREFIXES = ("acc/", "loss/", "ppl/", "time/")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
            return f"{v:.4g}"
        return f"{v:.4f}"
    return str(v)


class RecordSink(Protocol):
    """Where else a record goes (the experiment trackers): `send` must not block, `close` flushes."""

    def send(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class MetricsWriter:
    """Write one record per step; only the process that `active` (rank 0) writes. `sinks` get every record that
    metrics.jsonl gets (monitor.trackers)."""

    def __init__(self, run_dir: str | Path, active: bool, tensorboard_dir: Optional[str | Path] = None,
                 log_every: int = 1, sinks: Sequence[RecordSink] = ()):
        self.active = active
        self.log_every = max(1, log_every)
        self._jsonl = None
        self._tb = None
        self._sinks = list(sinks) if active else []
        if not active:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is in requirements.txt; say so if someone removed it
                logger.warning("tensorboard is not installed: no TensorBoard event files are written")
            else:
                self._tb = SummaryWriter(log_dir=str(tensorboard_dir))

    def write(self, step: int, metrics: dict[str, Any], kind: str = "train", console: Optional[bool] = None) -> None:
        """Record `metrics` at `step`; kind "train" goes to the console every log_every steps, others always."""
        if not self.active:
            return
        record = {"kind": kind, "step": step, **{k: v for k, v in metrics.items() if k != "step"}}
        self._jsonl.write(json.dumps(redact_tree(record), default=float) + "\n")  # text fields may quote a path
        for sink in self._sinks:
            sink.send(record)
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step" and math.isfinite(v):
                    self._tb.add_scalar(k if kind == "train" else f"{kind}/{k}" if not k.startswith(kind) else k, v, step)
        if console is None:
            console = kind != "train" or step % self.log_every == 0
        if console:
            logger.info(self.console_line(record))

    @staticmethod
    def console_line(record: dict[str, Any]) -> str:
        keys = [k for k in _CONSOLE_ORDER if k in record and record[k] is not None]
        rest = sorted(k for k in record if k not in keys and k != "kind" and record[k] is not None
                      and not k.startswith(_CONSOLE_SKIP_PREFIXES))
        prefix = "" if record.get("kind") == "train" else f"[{record.get('kind')}] "
        return prefix + ", ".join(f"{k}={_fmt(record[k])}" for k in keys + rest)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        for sink in self._sinks:
            sink.close()
        self._sinks = []
