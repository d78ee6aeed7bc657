"""The memory of one pipeline stage on one device, term by term (see the package docstring for each term)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .activations import StageActivations
from .figures import Layout, Memory
from .terms import ModelFigures, fsdp_share, per_device


@dataclass(frozen=True)
class StageContext:
    """What every stage of one estimate shares.

    autocast: 16-bit compute over fp32 parameters (precision internlm_core); comp: compute bytes; layers,
    checkpointed: blocks per stage and how many of them are recomputed; keeps_unsharded: FSDP keeps every
    gradient unsharded between micro-batches; fp32_gemm: the CPU linear path without native 16-bit GEMM;
    cached_casts: autocast casts the weights itself (not fp32_gemm) and caches each cast until its context
    exits; tokens: one micro-batch's tokens on one data-parallel rank; loss_peak, logits: bytes of the loss
    backward's transients and of the held logits (the last stage); recomputed: what the backward of the blocks
    holds beyond the head's and the loss's peak on the last stage (StageActivations.rebuilt_excess: the block
    being recomputed, the blocks offload copied back; 0 without either), counted in its activations;
    head_activations: what the head keeps of one micro-batch (the last stage)."""

    lay: Layout
    precision: str
    autocast: bool
    comp: int
    micro_num: int
    layers: int
    checkpointed: int
    keeps_unsharded: bool
    fp32_gemm: bool
    cached_casts: bool
    tokens: int
    loss_peak: float
    logits: float
    recomputed: float
    head_activations: float
    figures: ModelFigures
    fp8_gathered: float = 0.0   # bytes the float8 all-gather saves per gathered block (estimate/lowp.py)
    muon_matrices: float = 0.0  # elements of the stage's Muon matrices one device keeps (one buffer, not two)
    fp8_casts: float = 0.0      # the transient float8 operands of the largest converted linear (estimate/lowp.py)

    @property
    def fsdp_mp(self) -> bool:
        """FSDP's mixed precision (any data parallel) gathers 16-bit weights: autocast copies none of them."""
        return self.autocast and self.lay.dp > 1

    @property
    def gathered_itemsize(self) -> int:
        return self.comp if self.fsdp_mp else 4


def saved_casts(c: StageContext) -> float:
    """The 16-bit weight casts backward needs of one recomputed block (0 without autocast copies)."""
    return 2 * c.figures.block_matrices_local if c.checkpointed and c.autocast and not c.fsdp_mp else 0.0


def weight_copies(c: StageContext, with_head: bool) -> float:
    """16-bit casts of the weights autocast keeps (2 bytes per weight a matmul multiplies; none where FSDP
    gathers 16-bit weights).

    fp32_gemm (model/layers.py casts outside autocast): the casts saved for backward, those of the blocks that
    are not recomputed, of the one being recomputed, and of the output layer. Otherwise autocast casts each
    weight itself and caches the cast until its outermost context exits: every weight of the stage, recomputed
    blocks included, is held in 16 bits at the end of the forward (the trainer's context spans forward and loss;
    under pipeline parallel the whole step, backward included). Without pipeline parallel that moment precedes
    the recomputation of any block, whose activations (counted in activations) do not exist yet."""
    if not c.autocast or c.fsdp_mp:
        return 0.0
    f = c.figures
    head = f.head_matrices_local if with_head else 0
    blocks = c.layers - c.checkpointed + (1 if c.checkpointed else 0)
    saved = 2 * (blocks * f.block_matrices_local + head)
    if not c.cached_casts:
        return saved
    cached = 2 * (c.layers * f.block_matrices_local + head)
    return cached if c.lay.pp > 1 else max(saved, cached - c.recomputed)


def fsdp_gathered(c: StageContext, root: float, forward_first: bool) -> float:
    """Gathered tensors are new full-size buffers, beside the shards (counted in parameters).

    Pipeline: blocks stay gathered between micro-batches; the schedule's backwards are not the last
    (set_is_last_backward(False)), so FSDP keeps the fp32 reduce-scatter input of the unit it reduced last (the
    root, or the stage's first block) until the next micro-batch's backward. In 1F1B's steady state a forward
    gathers a block again while the other micro-batches are in flight: the all-gather's output and the
    unsharded parameters it is copied into coexist (a second copy of the unit). A stage that runs every forward
    first has no such moment. Otherwise: the running and the prefetched block, the root, one block's unsharded
    fp32 gradient."""
    if c.precision != "internlm_core" or c.lay.dp_shard <= 1:
        return 0.0
    w, block = c.gathered_itemsize, c.figures.block_local
    # one gathered block's bytes (converted weights in 1 byte: float8 all-gather); `big`: the largest block's, what
    # one unit at a time holds in a stack of several kinds of blocks (block_local is their mean: terms.py)
    wb = w * block - c.fp8_gathered
    big = max(c.figures.largest_block_local, block)
    wbig = w * big - c.fp8_gathered
    if c.lay.pp > 1:
        kept_input = 0 if forward_first else 4 * (root or big)
        regather = 0 if forward_first else max(wbig, w * root)
        return wb * c.layers + w * root + kept_input + regather
    return 2 * wbig + w * root + 4 * big


def fp32_gemm_transient(out_dim: float, in_dim: float, tokens: int) -> float:
    """What the backward of a 16-bit linear holds beyond its inputs on a CPU without native 16-bit GEMM
    (model/layers.py HalfLinearFp32Gemm: fp32 GEMMs, rounded once), o x i weight, t tokens: the fp32 output
    gradient (4 t o) throughout; for the input gradient the fp32 weight (4 o i) and the fp32 product (4 t i)
    with its 16-bit rounding (2 t i); for the weight gradient the fp32 input (4 t i, freed by the product) or
    the 16-bit rounding of the fp32 product (2 o i), beside that product (4 o i) and the input gradient."""
    return 4 * tokens * out_dim + 4 * out_dim * in_dim + 2 * tokens * in_dim \
        + max(4 * tokens * in_dim, 2 * out_dim * in_dim)


def gemm_copies(c: StageContext, with_head: bool, loss_peak: float) -> float:
    """fp32_gemm: the excess of the largest linear's backward over the peak counted otherwise. The output
    layer's backward follows the loss backward and the end of the forward: the loss's transients and the logits
    are gone, and no block is being recomputed yet. A block's backward follows the head's: what the head kept
    (its activations, its weight's 16-bit cast) is gone."""
    if not c.fp32_gemm:
        return 0.0
    f = c.figures
    block = max(fp32_gemm_transient(o, i, c.tokens) for o, i in f.local_linears(c.lay, head=False))
    if not with_head:
        return block
    head = max(fp32_gemm_transient(o, i, c.tokens) for o, i in f.local_linears(c.lay, head=True))
    head_copy = 2 * f.head_matrices_local if c.autocast and not c.fsdp_mp else 0.0
    return max(0.0, block - c.head_activations - head_copy,
               head - loss_peak - c.logits - c.recomputed - saved_casts(c))


def root_reduce(c: StageContext, mem: Memory, root: float, act: float, warmup: int, forward_first: bool,
                shard: float) -> float:
    """The root (embedding; final norm and output) is reduced last, when a backward ends: its gathered weights,
    the output layer's and the embedding's gradients (the output's from the start of backward) and FSDP's fp32
    reduce-scatter copy, while the stage's blocks are resharded and only the other micro-batches in flight keep
    activations. Where that exceeds the peak counted before, the excess adds (measured in the simulated stage,
    tests/e2e/test_simulate.py)."""
    if c.precision != "internlm_core" or c.lay.dp_shard <= 1 or not root:
        return 0.0
    w = g = c.gathered_itemsize
    flight = min(warmup, c.micro_num) if c.lay.pp > 1 else 1
    at_reduce = (w + g + 4) * root + act * (flight - 1) / flight \
        + (4 * shard if forward_first else 0)  # the step's first gradients exist by then
    before = mem.fsdp_gathered + mem.activations + mem.loss_peak + mem.gemm_copies
    return max(0.0, at_reduce - before)


def stage_memory(c: StageContext, name: str, act: float, first: bool, last: bool, warmup: int = 0) -> Memory:
    """The peak of one stage ("all", "first", "middle", "last"). warmup: the forwards a pipeline stage runs
    before its first backward (1F1B); when that is every micro-batch, the peak (all of them in flight) comes
    before any gradient of the step exists."""
    lay, f = c.lay, c.figures
    mem = Memory(stage=name)
    terms = f.stage_parameters(c.layers, first, last)
    held = per_device(terms, lay.sizes)
    forward_first = lay.pp > 1 and lay.num_chunks == 1 and c.micro_num <= warmup
    shard = fsdp_share(terms, lay)
    if c.precision == "internlm_core":  # fp32 parameters, gradients and AdamW moments, sharded by FSDP
        mem.parameters = 4 * shard
        mem.gradients = 0.0 if forward_first else 4 * shard
        mem.optimizer = 8 * shard - 4 * c.muon_matrices  # Muon: one momentum buffer per hidden matrix
        mem.fp8_casts = c.fp8_casts
        mem.weight_copies = weight_copies(c, last)
        if c.keeps_unsharded:  # every gradient unsharded in fp32 until the last micro-batch's reduction
            mem.accumulated_gradients = 4 * (held - shard)
    else:  # InternLM: bf16 parameters and gradients everywhere, fp32 master + moments over zero1
        mem.parameters = 2 * held
        mem.gradients = 2 * held
        mem.optimizer = 12 * held / lay.dp_shard
    root = (f.embedding_local if first else 0) + (f.head_local if last else 0)
    mem.fsdp_gathered = fsdp_gathered(c, root, forward_first)
    mem.activations = act
    mem.loss_peak = c.loss_peak if last else 0.0
    mem.gemm_copies = gemm_copies(c, last, mem.loss_peak)
    mem.root_reduce = root_reduce(c, mem, root, act, warmup, forward_first, shard)
    return mem


def pick_stage(c: StageContext, acts: StageActivations, shared: float, pipeline_rank: Optional[int]) -> Memory:
    """The stage `pipeline_rank` (a middle one, the first or the last), or the busiest of first and last."""
    lay = c.lay
    if pipeline_rank is not None and not 0 <= pipeline_rank < lay.pp:
        raise ValueError(f"pipeline_rank {pipeline_rank}: expected 0 <= rank < {lay.pp}")
    if lay.pp == 1:
        return stage_memory(c, "all", acts.last(c.loss_peak), True, True)
    if pipeline_rank is not None and 0 < pipeline_rank < lay.pp - 1:
        return stage_memory(c, "middle", acts.middle(lay, pipeline_rank, c.micro_num, shared), False, False,
                            warmup=lay.pp - pipeline_rank)
    first = stage_memory(c, "first", acts.first, True, False, warmup=lay.pp)
    last = stage_memory(c, "last", acts.last(c.loss_peak), False, True, warmup=1)
    return first if pipeline_rank == 0 else last if pipeline_rank == lay.pp - 1 else \
        max((first, last), key=lambda x: x.total)
