"""One training step's collectives as a pipeline stage issues them, outside a whole model: the loop's training metric
(AccPerplex over pp_dp), the loss reduction, the inf/nan flag, the gradient norm over the stages, the stop poll and
the straggler check. The stage without the last layer has no outputs: it counts nothing and holds a zero loss, which
is the case a CUDA run crashed on (the metric's sums were made on the host).

Used by the CPU device audit (tests/dist/stage_audit_driver.py: two gloo ranks of a two-stage pipeline, as if on
CUDA) and by the GPU check (bench/gpu_paths.py: one rank of a real NCCL group plays the non-last stage).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from internlm_core.metrics import AccPerplex
from internlm_core.monitor.stop import StopController
from internlm_core.monitor.straggler import diagnose_stragglers
from internlm_core.optim.clip import global_grad_norm
from internlm_core.trainer.readout import read_step
from internlm_core.trainer.trainer import Trainer


def stage_step_collectives(device: torch.device, last: bool, dims: Any, world_size: int, rank: int,
                           vocab: int = 11) -> dict[str, Any]:
    """Run each per-step collective of one pipeline stage on `device` (the run's device) and return what it gave.

    `last`: this rank holds the last stage (its micro-batch outputs feed the metric and the loss). `dims`: the
    layout as the loop sees it (ParallelDims, or anything with `dp`, `pp` and `group(name)`); `world_size`: the
    loop's (above 1 its inf/nan flag is agreed on by a collective).
    """
    out: dict[str, Any] = {}
    metric = AccPerplex({0: "en"}, dims.group("pp_dp"))
    loss = torch.zeros((), device=device)  # what forward_backward returns on a stage without the loss
    if last:
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(2, 5, vocab, generator=g).to(device)
        labels = torch.randint(0, vocab, (2, 5), generator=g).to(device)
        labels[0, 0] = -100
        metric.update(logits, labels, torch.zeros_like(labels))
        loss = torch.tensor(2.5, device=device)
    out["metric"] = metric.get_metric()
    loop = SimpleNamespace(dims=dims, world_size=world_size, device=device, loop=SimpleNamespace(micro_num=1))
    out["loss"] = Trainer._reduce_loss(loop, loss)
    inf_or_not = torch.tensor(float("inf") if last else 1.0, device=device)  # the last stage's gradient norm is inf
    out["finite"] = read_step(torch.zeros((), device=device), inf_or_not,  # the step's agreed flags: all skip
                              StopController(None, rank=rank, signals=(), group=None), device, world_size > 1).finite
    weight = torch.nn.Parameter(torch.zeros(3, device=device))
    weight.grad = torch.full((3,), 2.0 if last else 1.0, device=device)
    out["grad_norm"] = float(global_grad_norm([weight], pp_group=dims.group("pp")))
    out["grad_norm_no_grads"] = float(global_grad_norm([torch.nn.Parameter(torch.zeros(1, device=device))]
                                                       if not last else [weight], pp_group=dims.group("pp")))
    stop = StopController(None, rank=rank, signals=(), group=None)
    stop.signal_received = 15 if last else None  # SIGTERM seen by the last stage only: every rank stops
    out["stop"] = stop.poll(step=1).stop
    out["stragglers"] = len(diagnose_stragglers({"step_time": 1.0}, outlier_ratio=2.0).ranks)
    return out


def expected_two_stages(dp: int) -> dict[str, Any]:
    """What `stage_step_collectives` gives on every rank of a two-stage pipeline with `dp` ranks per stage."""
    return {"tokens": 9.0 * dp,  # each last stage counts its 10 labels but one
            "loss": 2.5, "finite": False, "grad_norm": 15 ** 0.5, "grad_norm_no_grads": 12 ** 0.5, "stop": True,
            "stragglers": 2 * dp}


def expected_non_last_alone() -> dict[str, Any]:
    """What it gives on one rank that holds a non-last stage alone (the GPU check's one-rank NCCL group)."""
    return {"tokens": 0.0, "loss": 0.0, "finite": True, "grad_norm": 3 ** 0.5, "grad_norm_no_grads": 0.0,
            "stop": False, "stragglers": 1}


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The values `expected_*` describe, from a `stage_step_collectives` result."""
    keys = ("loss", "finite", "grad_norm", "grad_norm_no_grads", "stop", "stragglers")
    out = {k: result[k] for k in keys}
    out["tokens"] = result["metric"]["tokens"]
    return out
