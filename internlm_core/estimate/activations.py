"""Bytes kept for backward, per token: the family's terms (ModelCounts) and the generic ones (logits, loss)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..fused_head import chunk_cols, chunk_rows
from ..model.counts import ActivationContext, Term
from .figures import Layout
from .pipeline import pipeline_in_flight
from .terms import ModelFigures, per_device

# Bytes of one fp32 chunk of rows of the fused chunked cross entropy (loss.py _CHUNK_BYTES, _CUDA_CHUNK_BYTES;
# tests/unit/test_estimate.py checks they agree)
FUSED_CHUNK_BYTES = {"cpu": 4 * 1024 * 1024, "cuda": 256 * 1024 * 1024}


@dataclass(frozen=True)
class TokenBytes:
    """Per token of one micro-batch on one device.

    block: a block that keeps its activations; checkpointed: a recomputed block (its input); selective: a block
    under selective recomputation (its input and its matmuls' outputs; None where the family gives no count);
    shared: once per micro-batch (ids, rotary tables, masks); head: the final norm, the output layer's input, what
    the loss keeps and the logits where they are held through backward; logits: the held logits alone (flash-attn's
    in-place backward overwrites them; a pipeline schedule keeps its last stage's output until its backward; else
    the trainer drops them before backward: 0); logits_forward: the logits that exist only until the loss forward
    ends (0 when held, and under the fused head); loss_peak: the loss backward's transient buffers;
    communication: the family's own collectives per block, by term.
    """

    block: float
    checkpointed: float
    shared: float
    head: float
    logits: float
    loss_peak: float
    communication: dict[str, float]
    selective: Optional[float] = None
    logits_forward: float = 0.0


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


def fused_forward_chunks(kernel: str, vocab: float, tokens: int, device: str, comp: int = 2) -> float:
    """The fused chunked cross entropy's forward (loss.py) holds fp32 chunks of rows: each chunk's fp32 copy of
    16-bit logits (fp32 logits: a view) and its exponentials; the previous chunk's are alive while the next one's
    are made (one more chunk when there are several). `vocab`: the logits' width on one device."""
    if not kernel.startswith("fused"):
        return 0.0
    rows = max(1, FUSED_CHUNK_BYTES.get(device, FUSED_CHUNK_BYTES["cpu"]) // int(4 * vocab))
    chunks = (1 if comp == 4 else 2) + (1 if tokens > rows else 0)
    return chunks * 4 * min(rows, tokens) * vocab


def fused_head_transients(vocab: float, hidden: int, tokens: int, comp: int, weight_itemsize: int,
                          device: str) -> float:
    """The fused head's (fused_head.py) buffers besides what it keeps: two fp32 chunks of logits (forward: a chunk
    of tokens' logits and their exponentials; backward: a chunk of vocabulary rows' recomputed logits turned
    gradient, and the next one's), the hidden states' fp32 gradient and a chunk's contribution to it, the weight's
    gradient in the compute dtype (cast to the weight's dtype where it differs) and the weight cast to the compute
    dtype where it differs; `vocab`: on one device."""
    dev = torch.device(device)
    cols = min(chunk_cols(tokens, dev), vocab)
    chunk = max(min(chunk_rows(int(vocab), dev), tokens) * vocab, tokens * cols)
    weight = vocab * hidden
    cast = comp * weight if weight_itemsize != comp else 0
    gradient = comp * weight + (weight_itemsize * weight if weight_itemsize != comp else 0)
    return 2 * 4 * chunk + (4 + comp) * tokens * hidden + gradient + cast


def token_bytes(figures: ModelFigures, args: Any, ctx: ActivationContext, lay: Layout, cross_entropy: str,
                micro_num: int) -> TokenBytes:
    """The per-token figures of the family's counts under `lay` and the loss kernel `cross_entropy`."""
    c, s = figures.counts, lay.sizes
    vocab = c.logits(args)
    logits = Term("logits", 0 if cross_entropy == "fused_head" else ctx.compute_bytes * vocab.value, vocab.shard)
    held = cross_entropy == "flash" or lay.pp > 1
    kept, peak = cross_entropy_terms(cross_entropy, ctx.compute_bytes, vocab, micro_num)
    # torch's kernels (and vocab_parallel) log-softmax an fp32 copy of 16-bit logits: it exists in the forward
    fp32_copy = Term("fp32 logits", 4 * vocab.value if cross_entropy in ("torch", "vocab_parallel")
                     and ctx.compute_bytes != 4 else 0, vocab.shard)
    selective = c.selective_block_activations
    return TokenBytes(
        block=per_device(c.block_activations(args, ctx), s),
        checkpointed=per_device(c.checkpointed_block_activations(args, ctx), s),
        shared=per_device(c.shared_activations(args, ctx), s),
        head=per_device(c.head_activations(args, ctx) + ([logits] if held else []) + [kept], s),
        logits=per_device([logits] if held else [], s),
        loss_peak=per_device([peak], s),
        communication=_by_name(c.block_communication(args, ctx), s),
        selective=per_device(selective(args, ctx), s) if selective is not None else None,
        logits_forward=0.0 if held else per_device([logits, fp32_copy], s),
    )


def _by_name(terms: list[Term], sizes: Any) -> dict[str, float]:
    """Per-device value of each named quantity (a name may come in several terms with different divisors)."""
    names = dict.fromkeys(t.name for t in terms)
    return {n: per_device([t for t in terms if t.name == n], sizes) for n in names}


@dataclass(frozen=True)
class StageActivations:
    """Activation bytes of the pipeline stages of one micro-batch layout.

    layers: per token, the stage's blocks (their kept bytes and the backward's transient `rebuilt`); first: the
    first stage's bytes (all micro-batches in flight, each counted with a transient); kept: per token, what the
    blocks hold on the device from their forward to their backward; rebuilt: per token, what the backward of the
    blocks holds beyond that at its most (the block being recomputed, under offload the blocks copied back), which
    does not coexist with the head's and the loss's tensors on the last stage (the head's backward is over
    before any block's begins); host: per token, the bytes offload keeps in host memory (one micro-batch);
    in_flight: micro-batches the first stage holds."""

    layers: float
    first: float
    in_flight: float
    tokens: int
    kept: float = 0.0
    rebuilt: float = 0.0
    shared: float = 0.0
    head: float = 0.0
    host: float = 0.0

    def middle(self, lay: Layout, rank: int, micro_num: int, shared: float) -> float:
        """A middle stage: its layers only, with (pp - rank) micro-batches in flight under 1F1B."""
        flight = pipeline_in_flight(lay, micro_num, rank)
        return self.tokens * flight * (self.layers + shared)

    def last(self, loss_peak: float) -> float:
        """The last stage's bytes at its peak: its blocks' kept bytes, the shared ones and the head's, and of the
        blocks' backward transient what exceeds the head's bytes and the loss's transient `loss_peak`."""
        return self.tokens * (self.kept + self.shared + self.head) + self.rebuilt_excess(loss_peak)

    def rebuilt_excess(self, loss_peak: float) -> float:
        """What the blocks' backward holds beyond the head's bytes and the loss's transient (0 if less)."""
        return max(0.0, self.tokens * (self.rebuilt - self.head) - loss_peak)


def block_policy(tb: TokenBytes, policy: str) -> tuple[float, float]:
    """(kept, rebuilt) per token of one recomputed block under `policy`: "full" keeps its input and rebuilds the
    whole block in its backward; "selective" keeps its input and its matmuls' outputs (the family's count, or
    every activation where it gives none) and rebuilds the rest (the kept outputs move into the rebuilt graph)."""
    if policy == "full":
        return tb.checkpointed, tb.block
    kept = tb.block if tb.selective is None else tb.selective
    return kept, tb.block - kept + tb.checkpointed


def stage_activations(tb: TokenBytes, lay: Layout, layers: int, checkpointed: int, micro_num: int,
                      tokens: int, offload: bool = False, policy: str = "full") -> StageActivations:
    """Under 1F1B the first stage holds up to min(pp, micro_num) micro-batches (more with interleaved chunks).
    `checkpointed` of the `layers` blocks are recomputed under `policy` (block_policy). With `offload`
    (model.offload_activations) what the blocks save moves to the host: a plain block's activations, a recomputed
    block's inputs (its hidden states and the tables it is passed, `shared`; a selective block's kept matmul
    outputs stay on the device, in the checkpoint's cache); in backward the device holds two blocks' worth, the
    one backward is in and the one prefetched (tensors under 16 KiB and the weights' views left out)."""
    in_flight = pipeline_in_flight(lay, micro_num, 0)  # from the schedule's action list (estimate/pipeline.py)
    plain = layers - checkpointed
    kept_ck, rebuilt = block_policy(tb, policy) if checkpointed else (0.0, 0.0)
    kept = plain * tb.block + checkpointed * kept_ck
    host = 0.0
    if offload:
        moved = tb.checkpointed + tb.shared  # what a checkpoint saves of a block: its inputs
        host = plain * tb.block + checkpointed * moved
        kept = checkpointed * (kept_ck - tb.checkpointed)
        rebuilt = max(min(plain, 2) * tb.block, rebuilt + min(checkpointed, 2) * moved if checkpointed else 0.0)
    layers_act = kept + rebuilt
    return StageActivations(layers_act, tokens * in_flight * (layers_act + tb.shared), in_flight, tokens,
                            kept=kept, rebuilt=rebuilt, shared=tb.shared, head=tb.head, host=host)
