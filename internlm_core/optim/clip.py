"""Global gradient norm, clipping, and the inf/nan verdict, for plain, FSDP2, TP and pipeline models."""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..utils import collectives


def _by_mesh(items: list, tensor_of) -> dict[object, list]:
    """`items` grouped by the mesh of their tensor (None: plain tensors), in first-seen order."""
    groups: dict[object, list] = {}
    for item in items:
        t = tensor_of(item)
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(item)
    return groups


def _full_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(norm, DTensor):  # FSDP/TP: the norm of the full gradient across the mesh
        norm = norm.full_tensor()
    return norm


@torch.no_grad()
def global_grad_norm(params: Iterable[torch.nn.Parameter], pp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """L2 norm of all gradients of the whole model (DTensor shards reduced; pipeline stages summed)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:  # nothing to clip here; a pipeline stage still takes part in the stages' sum below
        norm = torch.zeros((), device=collectives.group_device(pp_group) if pp_group is not None else None)
    else:
        # DTensor gradients on different meshes (a family's own dimension shards some parameters over another mesh
        # than the rest) cannot meet in one op: one norm per mesh, combined as a root of the sum of squares
        norms = [_full_norm(group) for group in _by_mesh(grads, lambda g: g).values()]
        norm = norms[0] if len(norms) == 1 else torch.stack([n.float() ** 2 for n in norms]).sum().sqrt()
    if pp_group is not None:  # each pipeline stage holds different parameters
        sq = norm.float() ** 2
        collectives.all_reduce(sq, group=pp_group)
        norm = sq.sqrt()
    return norm.float()


@torch.no_grad()
def unscale_and_norm(params: list[torch.nn.Parameter], inv_scale: float = 1.0,
                     pp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Unscale the gradients (fp16: `inv_scale`) and return their global norm as a device tensor (no host read:
    the trainer reads it with the rest of its step, trainer/readout.py)."""
    if inv_scale != 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inv_scale)
    return global_grad_norm(params, pp_group)


@torch.no_grad()
def clip_to_norm(params: list[torch.nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Clip the gradients to `max_norm` (<=0: no clip) given their finite global `norm` (a device tensor)."""
    if max_norm > 0:
        for group in _by_mesh([p for p in params if p.grad is not None], lambda p: p.grad).values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm.to(group[0].grad.device), foreach=True)


@torch.no_grad()
def clip_and_check(params: list[torch.nn.Parameter], max_norm: float, inv_scale: float = 1.0,
                   pp_group: Optional[dist.ProcessGroup] = None) -> tuple[float, bool]:
    """Unscale (fp16), compute the global norm, clip to `max_norm` (<=0: no clip). Returns (norm, finite); reads
    the norm on the host (one sync)."""
    norm = unscale_and_norm(params, inv_scale, pp_group)
    value = norm.item()
    finite = math.isfinite(value)
    if finite:
        clip_to_norm(params, max_norm, norm)
    return value, finite
