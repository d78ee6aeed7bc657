"""model.fused_head_loss = "auto", decided by the estimator: the fused head (fused_head.py) where the estimated peak
per device with it is lower by at least AUTO_MIN_SAVING than without it, on the device's own
loss kernel; the unfused head elsewhere (it costs no extra matmul). `estimate` decides so, and the trainer asks
`fit.fused_head_chosen` (the same estimate), so a run and its estimate agree.

Where it wins: the unfused head holds the logits in the compute dtype and what its loss keeps of them; the fused one
an fp32 log-sum-exp per token and two fp32 chunks. On a GPU with flash-attn's in-place loss the chunks (512 MiB
each) take back most of the 16-bit logits below ~8K tokens per rank at vocabulary 152K, and a peak taken inside the
blocks gains nothing either way; long sequences (configs/7B_128k.py), a CPU and the chunked or vocabulary-parallel
losses gain sooner.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from ..config import Config

AUTO_MIN_SAVING = 256 << 20


def with_fused_head(cfg: Config, value: bool) -> Config:
    """A copy of `cfg` with model.fused_head_loss = `value` (the rest shared)."""
    out = copy.copy(cfg)
    out.model = dataclasses.replace(cfg.model, fused_head_loss=value)
    return out


def pick_fused_head(on: Any, off: Any) -> Any:
    """The estimate of the two (with and without the fused head) that "auto" chooses, with a note saying why."""
    gain = (off.memory.total - on.memory.total) / 2**30
    chosen = on if off.memory.total - on.memory.total >= AUTO_MIN_SAVING else off
    chosen.notes.append(f"model.fused_head_loss=\"auto\": {'fused' if chosen is on else 'unfused'} head (the fused "
                        f"one's peak is {abs(gain):.2f} GiB {'lower' if gain >= 0 else 'higher'}; fused from "
                        f"{AUTO_MIN_SAVING >> 20} MiB lower)")
    return chosen
