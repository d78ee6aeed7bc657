"""Token dispatch: (token, choice) pairs sorted by expert, sent to the rank holding their expert and back.

Local part (`sort_pairs`): the kept pairs in expert order (stable: token order inside an expert), their token index
and combine weight, and the rows per global expert. With expert parallel (E experts over `ep` ranks, rank r holding
experts [r E/ep, (r+1) E/ep)), the sorted rows are already contiguous per destination rank:
1. the per-expert row counts go to every rank with one all_to_all_single (each rank learns how many rows each source
   sends for each of its local experts), and this rank's and the received counts reach the host with one copy (the
   layer's one host sync: the token all-to-alls and the expert GEMMs need their sizes there);
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

from .router import Routing, expert_counts


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
    """The (token, choice) pairs in expert order, the kept ones first: token [P], weight [P] (fp32, with its graph)
    and the kept rows per global expert counts [E] (a tensor on the pairs' device). Pairs dropped by capacity come
    after every kept one; `head(sum(counts))` keeps the kept ones (the sum is read on the host with the counts)."""

    token: torch.Tensor
    weight: torch.Tensor
    counts: torch.Tensor

    def head(self, n: int) -> "SortedPairs":
        """The first n pairs (the kept ones when n = sum(counts)), the same counts."""
        return SortedPairs(self.token[:n], self.weight[:n], self.counts)


def sort_pairs(routing: Routing, num_experts: int) -> SortedPairs:
    """Every pair of `routing`, the kept ones grouped by expert (token order inside each expert), then the dropped
    ones. Nothing here waits for the host: no boolean mask, no bincount (their shapes would depend on values)."""
    S, k = routing.experts.shape
    with torch.no_grad():
        flat_expert = routing.experts.reshape(-1)
        keep = None if routing.keep is None else routing.keep.reshape(-1)
        key = flat_expert if keep is None else torch.where(keep, flat_expert, num_experts)
        pairs = torch.argsort(key, stable=True)
        counts = expert_counts(flat_expert, num_experts, keep)
    return SortedPairs(pairs // k, routing.weights.reshape(-1)[pairs], counts)


ExpertFn = Callable[[torch.Tensor, list[int]], torch.Tensor]


@dataclass
class ExpertSplits:
    """The expert-parallel sizes of one forward, on the host: rows sent to each rank (send), received from each
    rank (recv), per local expert (local); received_counts [ep * E_local] the device's count matrix, source-major."""

    send: list[int]
    recv: list[int]
    local: list[int]
    received_counts: torch.Tensor


def exchange_counts(counts: torch.Tensor, group, ep_size: int) -> ExpertSplits:
    """Step 1 of the module docstring: the per-expert row counts [E] to every rank of `group`, and the sizes the
    token all-to-alls need on the host, with one copy (this rank's counts and the received ones together)."""
    num_local = counts.numel() // ep_size
    recv = torch.empty_like(counts)
    collectives.all_to_all_single(recv, counts, group=group)  # recv[s * num_local + j]: rows from s for local expert j
    sent, received = torch.stack([counts, recv]).view(2, ep_size, num_local).tolist()
    return ExpertSplits([sum(row) for row in sent], [sum(row) for row in received],
                        [sum(col) for col in zip(*received)], recv)


def run_expert_parallel(rows: torch.Tensor, splits: ExpertSplits, experts: ExpertFn, group,
                        ep_size: int) -> torch.Tensor:
    """rows [N, h] sorted by global expert (`splits` from `exchange_counts`) -> the experts' outputs for them
    [N, h], the experts living on the `ep_size` ranks of `group` (steps 2-3 of the module docstring)."""
    num_local = len(splits.local)
    received = all_to_all(rows, splits.recv, splits.send, group)
    with torch.no_grad():  # source-major -> expert-major (stable: source order kept inside an expert)
        local_expert = torch.arange(num_local, device=rows.device).repeat(ep_size)
        row_expert = torch.repeat_interleave(local_expert, splits.received_counts.to(rows.device),
                                             output_size=sum(splits.recv))
        by_expert = torch.argsort(row_expert, stable=True)
        back = torch.argsort(by_expert)
    out = experts(received.index_select(0, by_expert), splits.local)
    return all_to_all(out.index_select(0, back), splits.send, splits.recv, group)


def combine(expert_out: torch.Tensor, pairs: SortedPairs, num_tokens: int,
            out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """out[t] = sum over t's kept pairs of weight * expert output, accumulated in fp32 -> [num_tokens, h]. The
    product promotes to fp32 (the weights' dtype) without an fp32 copy of expert_out kept for the backward."""
    weighted = expert_out * pairs.weight.unsqueeze(-1)
    out = weighted.new_zeros(num_tokens, expert_out.shape[-1]).index_add(0, pairs.token, weighted)
    return out.to(out_dtype or expert_out.dtype)
