"""What a checkpoint says about itself: meta.json (step, tokens, layout, versions, contents, what resumes exactly,
the config) and the COMPLETE marker (step, kind, every file with its size and crc32)."""

from __future__ import annotations

import datetime
import platform
from typing import Any, Optional

import numpy as np
import torch

from .integrity import CHECKSUM
from .registry import StateRegistry
from ..utils.redact import redact_tree

FORMAT = "internlm_core/dcp"
FORMAT_VERSION = 1

RESUME_NOTES = {
    "exact": "Resuming with the same world layout (world_size, dp, tp, pp, zero1) and the same model, optimizer and "
             "data config restores model and optimizer state, schedules, train state, every data-parallel rank's "
             "loader position and every rank's RNG streams, so training continues with the same batches and the "
             "loss trajectory of an uninterrupted run (bitwise, given deterministic kernels).",
    "other_layout": {
        "model": "exact: DCP reshards parameters between data/zero/tensor/pipeline layouts",
        "optimizer": "exact: optimizer state is resharded the same way",
        "scheduler": "exact: lr and beta2 schedules and the grad scaler are global",
        "train_state": "exact: step counts and consumed tokens are global (num_consumed_samples_in_epoch is per "
                       "data-parallel rank and is taken from the rank chosen below)",
        "data": "each data-parallel rank d takes the loader state saved by rank d (rank d mod the saved dp size when "
                "there are more ranks now). internlm_core's TrainLoader counts rows consumed by all ranks together "
                "(data_state shows whether every dp rank agreed), so no row is skipped or repeated; rows are "
                "grouped into steps differently when dp * micro_num changes, so the batches of a step differ",
        "rng": "not exact: rank r gets the streams saved by rank r (rank r mod the saved world size when there are "
               "more ranks now)",
        "loss": "not bitwise: gradient reductions run in another order",
    },
}


def library_versions() -> dict[str, str]:
    """Versions of the libraries that wrote a checkpoint."""
    import internlm_core
    return {"internlm_core": str(getattr(internlm_core, "__version__", "0+unknown")), "torch": torch.__version__,
            "numpy": np.__version__, "python": platform.python_version()}


def build_meta(registry: StateRegistry, *, step: int, kind: str, reason: str, name: str,
               per_dp: dict[str, dict[str, Any]], layout: dict[str, int], config_text: str) -> dict:
    """meta.json of a checkpoint; `per_dp`: every dp_rank-scoped entry's state on every data-parallel rank."""
    summary = registry.global_states()
    data: dict[str, Any] = {}
    for entry, states in per_dp.items():
        values = list(states.values())
        data[entry] = {"per_dp_rank": states, "dp_ranks_agree": all(v == values[0] for v in values)}
    ts = summary.get("train_state", {})
    return redact_tree({  # it is uploaded with the checkpoint: no secret of the config or the data state in it
        "format": FORMAT, "format_version": FORMAT_VERSION, "step": step, "kind": kind, "name": name,
        "reason": reason, "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "num_consumed_tokens": ts.get("num_consumed_tokens"), "step_count": ts.get("step_count"),
        "layout": layout, "versions": library_versions(), "contents": registry.contents(),
        "state": summary, "data_state": data, "resume": RESUME_NOTES, "config": config_text,
    })


def build_marker(*, step: int, kind: str, name: str, reason: str, world_size: int, time: str,
                 files: dict[str, int], checksums: Optional[dict[str, str]] = None) -> dict:
    """The COMPLETE marker: written last, it lists every file of the checkpoint with its size and its crc32
    (integrity.py)."""
    marker = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": step, "kind": kind, "name": name,
              "reason": reason, "world_size": world_size, "time": time, "files": files}
    if checksums is not None:
        marker.update(checksum=CHECKSUM, checksums=checksums)
    return marker
