"""Token dispatch: (token, choice) pairs sorted by expert, sent to the rank holding their expert and back.

Local part (`sort_pairs`): the kept pairs in expert order (stable: token order inside an expert), their token index
and combine weight, and the rows per global expert. With expert parallel (E experts over `ep` ranks, rank r holding
experts [r E/ep, (r+1) E/ep)), the sorted rows are already contiguous per destination rank:
1. the per-expert row counts go to every rank with one all_to_all_single (each rank learns how many rows each source
   sends for each of its local experts);
2. the rows go with all_to_all_single and uneven splits (`all_to_all`, an autograd Function whose backward is the
   reverse all-to-all), arriving source-major; a stable sort by local expert groups them for the expert GEMMs;
3. the expert outputs are put back in source-major order and return with the reverse all-to-all, so each rank
   combines its own tokens' outputs: out[token] += weight * expert_output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ...utils import collectives

from .router import Routing


# the rows this process sent to other ranks with the token all-to-alls (forward and backward) since the last
# `pop_all_to_all_bytes` (the step's comm/all_to_all_bytes metric; what a rank sends itself is not sent)
_SENT = {"bytes": 0, "calls": 0}


def _count(x: torch.Tensor, in_splits: list[int], group) -> None:
    own = dist.get_rank(group)
    row = x[0].numel() * x.element_size() if x.shape[0] else 0
    _SENT["bytes"] += row * (sum(in_splits) - in_splits[own])
    _SENT["calls"] += 1


def pop_all_to_all_bytes() -> dict[str, int]:
    """{"bytes", "calls"} of the token all-to-alls since the last call (this process), and reset."""
    out = dict(_SENT)
    _SENT.update(bytes=0, calls=0)
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits along dim 0; the gradient takes the reverse route."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        collectives.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        _count(x, in_splits, group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        collectives.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        _count(grad, out_splits, ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Send in_splits[r] rows of x (in order) to rank r, receive out_splits[r] rows from rank r; differentiable."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


@dataclass
class SortedPairs:
    """The kept (token, choice) pairs in expert order: token [N], weight [N] (fp32, with its graph) and the rows
    per global expert counts [E] (a tensor on the pairs' device)."""

    token: torch.Tensor
    weight: torch.Tensor
    counts: torch.Tensor


def sort_pairs(routing: Routing, num_experts: int) -> SortedPairs:
    """The kept pairs of `routing` grouped by expert, token order inside each expert."""
    S, k = routing.experts.shape
    with torch.no_grad():
        flat_expert = routing.experts.reshape(-1)
        pairs = torch.arange(S * k, device=flat_expert.device)
        if routing.keep is not None:
            pairs = pairs[routing.keep.reshape(-1)]
        expert = flat_expert[pairs]
        order = torch.argsort(expert, stable=True)
        pairs = pairs[order]
        counts = torch.bincount(expert, minlength=num_experts)
    return SortedPairs(pairs // k, routing.weights.reshape(-1)[pairs], counts)


ExpertFn = Callable[[torch.Tensor, list[int]], torch.Tensor]


def run_expert_parallel(rows: torch.Tensor, counts: torch.Tensor, experts: ExpertFn, group,
                        ep_size: int) -> torch.Tensor:
    """rows [N, h] sorted by global expert (counts [E] per expert) -> the experts' outputs for them [N, h], the
    experts living on the `ep_size` ranks of `group` (steps 1-3 of the module docstring)."""
    num_local = counts.numel() // ep_size
    recv = torch.empty_like(counts)
    collectives.all_to_all_single(recv, counts, group=group)  # recv[s * num_local + j]: rows from s for local expert j
    send_splits = counts.view(ep_size, num_local).sum(dim=1).tolist()
    recv_counts = recv.view(ep_size, num_local)
    recv_splits = recv_counts.sum(dim=1).tolist()
    local_counts = recv_counts.sum(dim=0).tolist()
    received = all_to_all(rows, recv_splits, send_splits, group)
    with torch.no_grad():  # source-major -> expert-major (stable: source order kept inside an expert)
        local_expert = torch.arange(num_local, device=rows.device).repeat(ep_size)
        row_expert = torch.repeat_interleave(local_expert, recv_counts.reshape(-1).to(rows.device))
        by_expert = torch.argsort(row_expert, stable=True)
        back = torch.argsort(by_expert)
    out = experts(received.index_select(0, by_expert), local_counts)
    return all_to_all(out.index_select(0, back), send_splits, recv_splits, group)


def combine(expert_out: torch.Tensor, pairs: SortedPairs, num_tokens: int,
            out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """out[t] = sum over t's kept pairs of weight * expert output, accumulated in fp32 -> [num_tokens, h]."""
    weighted = expert_out.float() * pairs.weight.unsqueeze(-1)
    out = weighted.new_zeros(num_tokens, expert_out.shape[-1]).index_add(0, pairs.token, weighted)
    return out.to(out_dtype or expert_out.dtype)
