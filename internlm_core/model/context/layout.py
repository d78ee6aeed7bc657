"""Who holds which tokens under context parallel, and the per-micro-batch layout the attention kernels read.

A packed row of T tokens is cut into 2C equal chunks; context rank r of C holds chunks r and 2C-1-r (zigzag, or
head-tail): causal attention's work grows with the token index, so pairing an early chunk with a late one gives
every rank the same work. Rank r's model sees only its T/C tokens, in that order (`zigzag_indices`).

Rank layout of the "2d" mode (C = inner x outer): context rank r = o * inner + i. The `inner` consecutive ranks of
one outer group o exchange heads with all-to-all (the fast links when consecutive ranks share a node); the ring runs
over the outer groups between ranks of the same inner position i (they hold the same heads). "all_to_all" is
inner = C (one outer group), "ring" is inner = 1.

`build_context_meta` runs once per forward (outside the layers): from the whole rows' document ids, which the
trainer's cut keeps on the host (given only the local chunk's, it all-gathers them over the context group and
reads them back: the layout's only collective and host sync), it plans, for
the tokens this rank computes queries for and each block of keys it will see, which blocks of keys are not fully
masked (blockwise.plan_blocks). Every layer then reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ...utils import collectives
from ...utils.transfer import to_device
from .blockwise import Plan, TokenSet, plan_blocks, tile_sizes
from .counters import count_bytes

MODES = ("ring", "all_to_all", "2d")


def zigzag_indices(seq_len: int, size: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [seq_len // size] on `device` (default: the host, where the data cut happens): the token positions of
    one packed row that context rank `rank` of `size` holds, chunk `rank` then chunk 2*size-1-rank of the row's
    2*size equal chunks."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"zigzag_indices: expected 0 <= rank < size, got rank {rank} of size {size}")
    if seq_len % (2 * size):
        raise ValueError(f"zigzag_indices: seq_len {seq_len} must be a multiple of 2 * size = {2 * size} "
                         f"(context size {size}: each rank holds two of 2 * size equal chunks)")
    chunk = seq_len // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([first, last])


@dataclass
class ContextGroup:
    """The context-parallel group of this rank.

    group: the process group of the `size` context ranks (None: the default group); rank: this rank's index in
    it (its zigzag chunk). mode: "ring" (k/v travel around the ring), "all_to_all" (Ulysses: heads exchanged for
    sequence), "2d" (all-to-all inside groups of `inner` consecutive ranks, ring across them). `inner_group` (2d): the
    all-to-all group of this rank's `inner` ranks, made once by `make_inner_group` (set_context_parallel calls it)."""

    group: Optional[dist.ProcessGroup]
    size: int
    rank: int
    mode: str
    inner: int = 1
    inner_group: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"context parallel mode: expected one of {', '.join(MODES)}, got {self.mode!r}")
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"context parallel size: expected an int >= 1, got {self.size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"context parallel rank: expected 0 <= rank < size {self.size}, got {self.rank!r}")
        if self.mode != "2d" and self.inner != 1:
            raise ValueError(f"context parallel inner {self.inner}: only mode '2d' has an inner (all-to-all) size; "
                             f"mode {self.mode!r} takes inner 1")
        if not isinstance(self.inner, int) or self.inner < 1 or self.size % self.inner:
            raise ValueError(f"context parallel inner: expected a divisor of size {self.size}, got {self.inner!r}")
        if self.size > 1 and collectives.dist_ready():
            actual = (dist.get_world_size(self.group), dist.get_rank(self.group))
            if actual != (self.size, self.rank):
                raise ValueError(f"context parallel: size {self.size} and rank {self.rank} do not match the process "
                                 f"group's size {actual[0]} and this process's rank {actual[1]} in it")

    def __deepcopy__(self, memo: dict) -> "ContextGroup":
        """The same object: process groups are this process's handles, shared and never copied (a deep copy of a
        model under context parallel keeps its group)."""
        return self

    @property
    def a2a_size(self) -> int:
        """Ranks of one all-to-all (1: none)."""
        return {"ring": 1, "all_to_all": self.size, "2d": self.inner}[self.mode]

    def global_rank(self, context_rank: int) -> int:
        """The global rank of context rank `context_rank` (peers of the ring's sends and receives)."""
        if self.group is None or self.size == 1:
            return context_rank
        return dist.get_global_rank(self.group, context_rank)

    def a2a_order(self, outer: int) -> list[int]:
        """The context ranks of outer group `outer` in the rank order of its all-to-all group (the order in which
        an all-to-all gathers their tokens): the context group's own order, or, for a 2d subgroup, ascending
        global rank (dist.new_group sorts its ranks)."""
        a = self.a2a_size
        ranks = [outer * a + j for j in range(a)]
        if self.mode != "2d" or a in (1, self.size):
            return ranks
        return sorted(ranks, key=self.global_rank)


def make_inner_group(context: ContextGroup) -> None:
    """Create the all-to-all subgroup of a 2d context group (once; a no-op for the other modes). Only the `inner`
    ranks of one outer group call dist.new_group for it (use_local_synchronization), so groups of different
    data-parallel replicas never wait for each other."""
    a = context.inner
    if context.mode != "2d" or a in (1, context.size) or context.inner_group is not None:
        return
    outer = context.rank // a
    ranks = [context.global_rank(outer * a + j) for j in range(a)]
    group = dist.new_group(ranks, use_local_synchronization=True)
    members = dist.get_process_group_ranks(group)
    if members != [context.global_rank(r) for r in context.a2a_order(outer)]:
        raise RuntimeError(f"2d context parallel: the inner group's rank order {members} is not ascending global "
                           f"rank; the token order of its all-to-all would be wrong")
    context.inner_group = group


@dataclass
class RingPeers:
    """The ring of one forward: `size` positions; this rank sends to `next` and receives from `prev` (global ranks),
    over `group`; bytes are counted under `tag` (the mode)."""

    group: Optional[dist.ProcessGroup]
    size: int
    next: int
    prev: int
    tag: str


@dataclass
class ContextMeta:
    """The per-micro-batch layout under context parallel, shared by every layer (PackedMeta.context).

    query: the tokens whose queries this rank computes (its own; after the all-to-all, its inner group's);
    sources[s]: the tokens of the keys it holds at ring step s (one entry, `query`, without a ring);
    plans[s]: which key blocks of sources[s] each query block needs; ring: None without a ring;
    a2a_group / a2a_size: the all-to-all (size 1: none); window: sliding-window keys per query (None: no window)."""

    context: ContextGroup
    query: TokenSet
    sources: list[TokenSet]
    plans: list[Plan]
    ring: Optional[RingPeers]
    a2a_group: Optional[dist.ProcessGroup]
    a2a_size: int
    window: Optional[int] = None


def local_positions(context: ContextGroup, local_len: int, device: torch.device) -> torch.Tensor:
    """int64 [local_len]: the row positions of this rank's tokens (position_ids of rows that are one document)."""
    return zigzag_indices(local_len * context.size, context.size, context.rank, device)


def _global_documents(context: ContextGroup, local: torch.Tensor) -> torch.Tensor:
    """int64 [B, T] document ids of whole rows, on local's device, from every rank's local chunk [B, T/C]."""
    B, Tl = local.shape
    C, T = context.size, Tl * context.size
    if C == 1:
        return local
    # filled with the local ids, not empty: under a simulated job's fake process group, which moves nothing, every
    # chunk then looks like this one (whole documents, the real work) instead of uninitialized ids
    parts = [local.clone() for _ in range(C)]
    collectives.all_gather(parts, local.contiguous(), group=context.group)
    count_bytes("layout", local.numel() * local.element_size() * (C - 1))
    out = torch.empty((B, T), dtype=local.dtype, device=local.device)
    for r, part in enumerate(parts):
        out[:, zigzag_indices(T, C, r, local.device)] = part
    return out


def _tokens(ranks: list[int], T: int, C: int, doc: torch.Tensor, doc_host: torch.Tensor) -> TokenSet:
    """The tokens of context ranks `ranks`, concatenated in that order (an all-to-all's gathered order)."""
    index = torch.cat([zigzag_indices(T, C, r) for r in ranks])
    on_device = torch.cat([zigzag_indices(T, C, r, doc.device) for r in ranks])  # made there: no copy to wait for
    return TokenSet(on_device, doc[:, on_device], index, doc_host[:, index])


def build_context_meta(context: ContextGroup, document_ids: Optional[torch.Tensor], batch: int, local_len: int,
                       device: torch.device, window: Optional[int] = None) -> ContextMeta:
    """The layout of one micro-batch of `batch` rows, each rank holding `local_len` tokens of a row (zigzag).

    document_ids: [B, T] the document of every token of the rows (host: nothing exchanged, nothing read back from
    the device; the trainer's cut gives them) or [B, T/C] of the local tokens only (every context rank must give
    the local chunk: they are all-gathered and read back on the host once); None: every row is one document.
    Document ids are compared within a row only; equal ids must mean the same document on every rank."""
    C, a = context.size, context.a2a_size
    T = local_len * C
    if document_ids is None:
        document_ids = torch.zeros((batch, T), dtype=torch.int64, device="cpu")  # the host's, as the trainer's
    if tuple(document_ids.shape) not in ((batch, local_len), (batch, T)):
        raise ValueError(f"context parallel: document_ids must be the local chunk [{batch}, {local_len}] "
                         f"(B, T / {context.size}) or the whole rows [{batch}, {T}], got {list(document_ids.shape)}")
    zigzag_indices(T, C, context.rank)  # checks T % 2C
    if document_ids.shape[1] == T:
        doc_host = document_ids.to(device="cpu", dtype=torch.int64)
        doc = to_device(doc_host, device)
    else:
        doc = _global_documents(context, to_device(document_ids.to(torch.int64), device))
        doc_host = doc.cpu()  # the block plans are made on the host: one copy per forward
    n, o, i = C // a, context.rank // a, context.rank % a
    if context.mode == "2d" and 1 < a < C and context.inner_group is None:
        raise ValueError("2d context parallel: the inner all-to-all group is missing (call set_context_parallel "
                         "or make_inner_group on the ContextGroup first)")
    groups = [context.a2a_order(g) for g in range(n)]  # context ranks of each outer group, in all-to-all order
    query = _tokens(groups[o], T, C, doc, doc_host)
    sources = [query] + [_tokens(groups[(o - s) % n], T, C, doc, doc_host) for s in range(1, n)]
    plans = [plan_blocks(query, src, window, *tile_sizes(doc.device)) for src in sources]
    ring = None
    if n > 1:
        ring = RingPeers(context.group, n, next=context.global_rank(((o + 1) % n) * a + i),
                         prev=context.global_rank(((o - 1) % n) * a + i), tag=context.mode)
    a2a_group = context.inner_group if context.mode == "2d" and a < C else context.group
    return ContextMeta(context, query, sources, plans, ring, a2a_group, a, window)
