"""Bytes kept for backward, per token: the family's terms (ModelCounts) and the generic ones (logits, loss)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..fused_head import chunk_rows
from ..model.counts import ActivationContext, Term
from .figures import Layout
from .terms import ModelFigures, per_device

# Bytes of one fp32 chunk of rows of the fused chunked cross entropy (loss.py _CHUNK_BYTES, _CUDA_CHUNK_BYTES;
# tests/unit/test_estimate.py checks they agree)
FUSED_CHUNK_BYTES = {"cpu": 4 * 1024 * 1024, "cuda": 256 * 1024 * 1024}


@dataclass(frozen=True)
class TokenBytes:
    """Per token of one micro-batch on one device.

    block: a block that keeps its activations; checkpointed: a recomputed block (its input); shared: once per
    micro-batch (ids, rotary tables, masks); head: the final norm, the output layer's input, the logits and what
    the loss keeps; logits: the logits alone; loss_peak: the loss backward's transient buffers; communication:
    the family's own collectives per block, by term.
    """

    block: float
    checkpointed: float
    shared: float
    head: float
    logits: float
    loss_peak: float
    communication: dict[str, float]


def cross_entropy_terms(kernel: str, comp: int, vocab: Term, micro_num: int) -> tuple[Term, Term]:
    """(what the loss keeps for backward, its backward's transient buffers) per token.

    torch's (and vocab_parallel's) keeps the fp32 log-softmax (4V) and needs two more fp32 V-wide buffers (8V)
    in backward; the fused chunked kernel keeps its precomputed gradient (a*V), scaled in place (fp32 under a
    factor other than 1: a new a*V); flash-attn's keeps nothing (its in-place backward overwrites the logits); the
    fused head (model.fused_head_loss) keeps each token's fp32 log-sum-exp, no logits."""
    if kernel == "fused_head":
        return Term("cross entropy", 4), Term("cross entropy backward", 0)
    fused = kernel.startswith("fused")
    kept = 0 if kernel == "flash" else comp * vocab.value if fused else 4 * vocab.value
    peak = 8 * vocab.value if kernel in ("torch", "vocab_parallel") else \
        comp * vocab.value if fused and comp == 4 and micro_num > 1 else 0
    return Term("cross entropy", kept, vocab.shard), Term("cross entropy backward", peak, vocab.shard)


def fused_forward_chunks(kernel: str, vocab: float, tokens: int, device: str) -> float:
    """The fused chunked cross entropy's forward holds two fp32 chunks of rows at a time (the logits of the
    chunk in fp32 and their exponentials); `vocab`: the logits' width on one device."""
    if not kernel.startswith("fused"):
        return 0.0
    rows = max(1, FUSED_CHUNK_BYTES.get(device, FUSED_CHUNK_BYTES["cpu"]) // int(4 * vocab))
    return 2 * 4 * min(rows, tokens) * vocab


def fused_head_transients(vocab: float, hidden: int, tokens: int, comp: int, weight_itemsize: int,
                          device: str) -> float:
    """The fused head's (fused_head.py) buffers besides what it keeps: two fp32 chunks of logits (forward: the
    logits and their exponentials; backward: the recomputed logits turned gradient and its cast), the weight's
    fp32 gradient accumulator (returned as it is for fp32 weights, else cast to the weight's dtype) and the weight
    cast to the compute dtype where it differs; `vocab`: on one device."""
    rows = chunk_rows(int(vocab), torch.device(device))
    weight = vocab * hidden
    cast = comp * weight if weight_itemsize != comp else 0
    returned = weight_itemsize * weight if weight_itemsize != 4 else 0
    return 2 * 4 * min(rows, tokens) * vocab + 4 * weight + returned + cast


def token_bytes(figures: ModelFigures, args: Any, ctx: ActivationContext, lay: Layout, cross_entropy: str,
                micro_num: int) -> TokenBytes:
    """The per-token figures of the family's counts under `lay` and the loss kernel `cross_entropy`."""
    c, s = figures.counts, lay.sizes
    vocab = c.logits(args)
    logits = Term("logits", 0 if cross_entropy == "fused_head" else ctx.compute_bytes * vocab.value, vocab.shard)
    kept, peak = cross_entropy_terms(cross_entropy, ctx.compute_bytes, vocab, micro_num)
    return TokenBytes(
        block=per_device(c.block_activations(args, ctx), s),
        checkpointed=per_device(c.checkpointed_block_activations(args, ctx), s),
        shared=per_device(c.shared_activations(args, ctx), s),
        head=per_device(c.head_activations(args, ctx) + [logits, kept], s),
        logits=per_device([logits], s),
        loss_peak=per_device([peak], s),
        communication=_by_name(c.block_communication(args, ctx), s),
    )


def _by_name(terms: list[Term], sizes: Any) -> dict[str, float]:
    """Per-device value of each named quantity (a name may come in several terms with different divisors)."""
    names = dict.fromkeys(t.name for t in terms)
    return {n: per_device([t for t in terms if t.name == n], sizes) for n in names}


@dataclass(frozen=True)
class StageActivations:
    """Activation bytes of the pipeline stages of one micro-batch layout.

    layers: per token, the stage's blocks (recomputed ones keep their input; one is rebuilt at a time in
    backward); first / last: the first stage's (all micro-batches in flight) and the last's (with the head)
    bytes; in_flight: micro-batches the first stage holds."""

    layers: float
    first: float
    last: float
    in_flight: float
    tokens: int

    def middle(self, lay: Layout, rank: int, micro_num: int, shared: float) -> float:
        """A middle stage: its layers only, with (pp - rank) micro-batches in flight under 1F1B."""
        flight = min(lay.pp - rank, micro_num) * self.in_flight / min(lay.pp, micro_num)
        return self.tokens * flight * (self.layers + shared)


def stage_activations(tb: TokenBytes, lay: Layout, layers: int, checkpointed: int, micro_num: int,
                      tokens: int, offload: bool = False) -> StageActivations:
    """Under 1F1B the first stage holds up to min(pp, micro_num) micro-batches (more with interleaved chunks).
    With `offload` (model.offload_activations) the blocks' saved tensors are on the host: the device holds two
    blocks' worth, the one backward is in and the one prefetched (kept small tensors and weights' views left out)."""
    in_flight = min(lay.pp, micro_num) if lay.pp > 1 else 1
    if lay.pp > 1 and lay.num_chunks > 1:
        in_flight *= 1 + (lay.pp - 1) / (lay.pp * lay.num_chunks)
    layers_act = (layers - checkpointed) * tb.block + checkpointed * tb.checkpointed + \
        (tb.block if checkpointed else 0)
    if offload:
        layers_act = min(layers_act, min(layers, 2) * tb.block)
    return StageActivations(layers_act, tokens * in_flight * (layers_act + tb.shared),
                            tokens * (layers_act + tb.shared + tb.head), in_flight, tokens)
