"""The training step's one host read (issue 34 item 4): everything the host needs of a step comes back in one
device-to-host copy, after one all-reduce that agrees on the step's flags.

On a GPU each read of a device value makes the host wait for the device (a sync). A step needs the host for the
skip decision on an inf/nan gradient (the lr and beta2 schedulers, the fp16 loss scale and the step counters are
host state), for the stop request (stop file, signals) and for the values written to metrics.jsonl every step
(loss, grad_norm, acc/ppl). Instead of one read each (the norm, the agreed finite flag, the loss, the metric sums,
the stop request: 7 syncs per step before), `read_step` packs them into one float64 vector and copies it to the
host once. The flags travel in one MAX all-reduce over the world: "some rank's gradient is not finite" (a
replicated parameter's gradient is not reduced across tensor-parallel ranks, so one rank alone may see it) with
the stop request (`StopController.sample`), replacing the stop poll's own all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..monitor.stop import StopController
from ..utils import collectives


@dataclass(frozen=True)
class StepValues:
    """A step's values on the host: the global loss, the global gradient norm, whether every rank's gradient is
    finite, and the training metric's reduced sums (AccPerplex.get_metric's `sums`; None if not read)."""

    loss: float
    grad_norm: float
    finite: bool
    metric_sums: Optional[torch.Tensor]


def read_step(loss: torch.Tensor, norm: torch.Tensor, stopper: StopController, device: torch.device,
              agree: bool, metric_sums: Optional[torch.Tensor] = None) -> StepValues:
    """The step's one host read. `loss`, `norm`: device scalars (already global); `stopper`: its request is sampled
    here and the agreed one handed back (`StopController.agree`: its next poll decides from it); `agree`: MAX the
    flags over the world (a collective: every rank calls it, when a process group exists); `metric_sums`:
    AccPerplex.reduced_sums() on the device, or None."""
    stop_sample = stopper.sample()
    # made on the device from Python scalars (a fill, no host-to-device copy of host memory)
    request = [torch.full((1,), v, dtype=torch.int64, device=device) for v in stop_sample]
    flags = torch.cat([(~torch.isfinite(norm.to(device))).reshape(1).long(), *request])
    if agree and collectives.dist_ready():
        collectives.all_reduce(flags, op=dist.ReduceOp.MAX)
    parts = [loss.to(device).double().reshape(1), norm.to(device).double().reshape(1), flags.double()]
    if metric_sums is not None:
        parts.append(metric_sums.to(device).double().flatten())
    host = torch.cat(parts).cpu()  # the one sync of the step
    loss_v, norm_v, nonfinite, file_value, sig = host[:5].tolist()
    sums = host[5:].view(metric_sums.shape) if metric_sums is not None else None
    stopper.agree(stop_sample[1], int(file_value), int(sig))
    return StepValues(loss_v, norm_v, nonfinite == 0.0, sums)
