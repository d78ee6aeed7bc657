"""Global gradient norm, clipping, and the inf/nan verdict, for plain, FSDP2, TP and pipeline models."""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def global_grad_norm(params: Iterable[torch.nn.Parameter], pp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """L2 norm of all gradients of the whole model (DTensor shards reduced; pipeline stages summed)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(norm, DTensor):  # FSDP/TP: the norm of the full gradient across the mesh
        norm = norm.full_tensor()
    if pp_group is not None:  # each pipeline stage holds different parameters
        sq = norm.float() ** 2
        dist.all_reduce(sq, group=pp_group)
        norm = sq.sqrt()
    return norm.float()


@torch.no_grad()
def clip_and_check(params: list[torch.nn.Parameter], max_norm: float, inv_scale: float = 1.0,
                   pp_group: Optional[dist.ProcessGroup] = None) -> tuple[float, bool]:
    """Unscale (fp16), compute the global norm, clip to `max_norm` (<=0: no clip). Returns (norm, finite)."""
    if inv_scale != 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inv_scale)
    norm = global_grad_norm(params, pp_group)
    value = norm.item()
    finite = math.isfinite(value)
    if finite and max_norm > 0:
        with_grad = [p for p in params if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, norm.to(with_grad[0].grad.device), foreach=True)
    return value, finite
