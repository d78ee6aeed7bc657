"""Context parallel, generically: the model's attention is told its context group (model/context's
`set_context_parallel`), and the trainer feeds each rank its zigzag chunk of every packed row (`ContextCut`).

The ranks of one context group read the same rows. Each cuts every row of T tokens into 2C chunks and keeps
chunks r and 2C-1-r (equal causal work per rank), with the labels, positions, dataset types and per-token document
ids of those tokens, on the host. The ranks' terms of the loss sum to the whole micro-batch's, as one rank computes
it (the loss contract: loss_norm.py): under token_mean each chunk's term is its loss sum (no share needed); under
micro_batch_mean the mean over its chunk's tokens times its share of the micro-batch's counted tokens
(`loss_share`, loss_norm.context_share).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..distributed.parallel_dims import ParallelDims
from ..loss_norm import context_share
from ..model import document_ids_from_cu_seqlens
from ..model.mtp import MTP_KEYS
from ..utils.logging import get_logger

logger = get_logger(__name__)

# the per-token tensors of a micro-batch, [rows, seq_len] each: cut along the sequence
ROW_KEYS = ("input_ids", "labels", "position_ids", "type_ids")


def apply_context_parallel(model: nn.Module, dims: ParallelDims, mode: str, inner: int,
                           chunks: tuple[nn.Module, ...] = ()) -> None:
    """Give `model`'s attention this rank's context group (after tensor parallel, before checkpointing, compile
    and FSDP): from then on it expects the local zigzag chunk of each row, with per-token document ids. `chunks`:
    the pipeline stages this rank runs (views sharing `model`'s layers, each a transformer of its own)."""
    from ..model.context import ContextGroup, set_context_parallel  # imported when used: CP runs only

    group = ContextGroup(dims.group("cp"), dims.cp, dims.cp_rank, mode, inner=inner)
    set_context_parallel(model, group)
    for chunk in chunks:
        if chunk is not model and "context" in vars(chunk):
            chunk.context = group  # the layers are the model's: their attention already has the group
    logger.info(f"context parallel {dims.cp} ({mode}{f', inner {inner}' if mode == '2d' else ''}): "
                f"rank {dims.cp_rank} keeps zigzag chunks {dims.cp_rank} and {2 * dims.cp - 1 - dims.cp_rank} "
                f"of {2 * dims.cp} of every sequence")


@dataclass
class ContextCut:
    """Cuts a host micro-batch (ROW_KEYS [rows, T] and `cu_seqlens`) into this rank's zigzag chunk: ROW_KEYS
    [rows, T / size], `document_ids` [rows, T / size] instead of cu_seqlens (and `row_document_ids` [rows, T], all
    on the host, which the model's layout reads without exchanging the chunks' ids or waiting for the device), and
    `loss_share`: the chunk's counted tokens (labels != -100) over the micro-batch's, the factor of this rank's
    mean loss under loss.reduction micro_batch_mean (token_mean needs none)."""

    size: int
    rank: int
    _indices: dict = field(default_factory=dict, repr=False)  # seq_len -> the chunk's token indices

    @classmethod
    def of(cls, dims: ParallelDims) -> "ContextCut | None":
        """The cut of this rank; None without context parallel."""
        return cls(dims.cp, dims.cp_rank) if dims.cp > 1 else None

    def indices(self, seq_len: int) -> torch.Tensor:
        if seq_len not in self._indices:
            from ..model.context import zigzag_indices
            self._indices[seq_len] = zigzag_indices(seq_len, self.size, self.rank)
        return self._indices[seq_len]

    def __call__(self, mb: dict) -> dict:
        rows, seq_len = mb["input_ids"].shape
        idx = self.indices(seq_len)
        out = {k: mb[k][:, idx].contiguous() for k in ROW_KEYS + MTP_KEYS if k in mb}  # model.mtp: its targets too
        docs = document_ids_from_cu_seqlens(mb["cu_seqlens"], rows, seq_len)
        out["document_ids"] = docs[:, idx].contiguous()
        out["row_document_ids"] = docs  # the whole rows': the layout needs no exchange of the chunks' ids
        out["loss_share"] = context_share(out["labels"], mb["labels"])
        if "mtp_labels" in mb:  # model.mtp (micro_batch_mean): each depth's share of its counted targets
            out["mtp_shares"] = [context_share(out["mtp_labels"][..., k], mb["mtp_labels"][..., k])
                                 for k in range(mb["mtp_labels"].shape[-1])]
        return out

    @staticmethod
    def step_metrics() -> dict[str, int]:
        """comm/context_{ring,all_to_all,2d,layout}_bytes: what this rank sent for context parallel since the last
        step's record (attention exchanges forward and backward, validation forwards included; model/context)."""
        from ..model.context import pop_context_bytes
        return {f"comm/context_{k}_bytes": v for k, v in pop_context_bytes().items() if v}
