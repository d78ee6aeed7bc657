"""What every experiment tracker adapter is (`Tracker`), what it is told when it opens (`RunInfo`), and the shapes
it sends: a record's numbers, the config as dotted keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol


@dataclass(frozen=True)
class RunInfo:
    """The run a tracker opens or continues.

    key: this run's tracker key (kept in the checkpoint): wandb's run id, an mlflow tag that finds the run again.
    resumed: the key came from a checkpoint (continue that run; the config was logged when it started).
    """

    key: str
    project: str
    name: str
    run_dir: str
    config: dict = field(default_factory=dict)
    resumed: bool = False
    timeout_s: float = 30.0


class Tracker(Protocol):
    """One experiment tracker. Every method but `prepare` runs in the tracker's own background thread; any may raise:
    the hub (hub.py) warns once and keeps training going."""

    name: str

    def prepare(self) -> None:
        """Import the tracker's package. Called in the training thread before the first step (an import holds the
        interpreter for seconds: in the tracker's thread it would slow the steps it overlaps)."""

    def open(self, run: RunInfo) -> str:
        """Start (or continue, when `run.resumed`) the tracker's run; log `run.config` when it is new. Returns
        where the run is (a URL or folder), for the log."""

    def log(self, step: int, values: dict[str, float]) -> None:
        """One metrics record at `step`."""

    def close(self) -> None:
        """Finish the run (flush what the tracker buffers)."""


def numeric_values(record: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a metrics.jsonl record (booleans as 0/1), without its `kind` and `step`."""
    out: dict[str, float] = {}
    for k, v in record.items():
        if k in ("kind", "step") or isinstance(v, str) or v is None:
            continue
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            continue
    return out


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"model.hidden_size": 128, ...}: a nested config as one level of dotted keys (mlflow's parameters)."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
