"""What a family's module holds, computes and keeps for backward, in named terms: the estimator's inputs.

A family gives its `ModelSpec` a `ModelCounts` (`counts=`); internlm_core/estimate/ sums the terms under a
parallel layout and adds what is generic (ZeRO / FSDP sharding, FSDP buffers, pipeline micro-batches in flight,
autocast weight copies, the loss kernel, the CPU GEMM path). Nothing in the estimator knows a family's formulas.

Every count is a `Term`: a name, a value (parameters, bytes per token, FLOPs) and the mesh dimensions that divide
it on one device:

    "tp"   tensor parallel (heads, FFN columns, vocabulary rows)
    "sp"   tensor parallel where sequence parallel is on, else 1 (the norm side of a block)
    <name> a dimension the family's plan adds (`ParallelPlan.mesh_dims`, e.g. "ep" for expert parallel): carved
           out of the sharded data-parallel ranks, so FSDP shards what it divides over the rest of them only

A mixture-of-experts family lists its expert weights as Linears divided by ("ep", "tp"), its capacity-bounded
expert activations as block activation terms (the capacity factor is in its args), and its all-to-all bytes
as `block_communication`; a context-parallel attention divides its per-token terms by its own dimension. Terms
with the same dimensions are summed before the division (exact integer sums, as one formula would be).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from .attention import CAUSAL_BLOCK


@dataclass(frozen=True)
class Term:
    """A named count and the mesh dimensions (see the module docstring) that divide it on one device."""

    name: str
    value: float
    shard: tuple[str, ...] = ()


@dataclass(frozen=True)
class Linear:
    """A weight a matmul multiplies: out_features x in_features, split over the mesh dimensions `shard` along
    `split` ("out": column-parallel, "in": row-parallel). Under autocast its 16-bit cast is a weight copy; on a
    CPU without native 16-bit GEMM its backward runs in fp32 (the estimator's `fp32_gemm` transient).
    own=False: the weight of another parameter (a tied output layer), multiplied and cast here, counted there."""

    name: str
    out_features: int
    in_features: int
    shard: tuple[str, ...] = ()
    split: str = "out"
    own: bool = True

    @property
    def elements(self) -> int:
        return self.out_features * self.in_features

    def local_shape(self, divisor: int) -> tuple[float, float]:
        """(out, in) on one device when the mesh dimensions of `shard` have `divisor` ranks in all."""
        if self.split == "in":
            return float(self.out_features), self.in_features / divisor
        return self.out_features / divisor, float(self.in_features)


@dataclass(frozen=True)
class Parameters:
    """The parameters of one part of a model (a block, the embedding side, the head side): its matmul weights
    and the rest (norm scales, biases, embedding tables), which autocast does not cast."""

    linears: tuple[Linear, ...] = ()
    others: tuple[Term, ...] = ()

    def terms(self) -> list[Term]:
        """Every parameter it owns, as terms (a tied weight is counted where it is owned)."""
        return [Term(w.name, w.elements, w.shard) for w in self.linears if w.own] + list(self.others)

    @property
    def count(self) -> int:
        return int(sum(t.value for t in self.terms()))


@dataclass(frozen=True)
class ActivationContext:
    """What decides the bytes a block keeps for backward, resolved by the estimator from the run's numerics.

    compute_bytes: bytes of an activation in the compute dtype (2 under bf16/fp16, 4 in fp32).
    residual_bytes: bytes of the residual stream (4 under autocast, where it stays fp32; else compute_bytes).
    norm_tensors: tensors an RMSNorm keeps per element: 1 (CUDA's fused kernel, InternLM's apex norm: its
        input), 2 (torch's composite norm on CPU: input and normalized output).
    norm_bytes: bytes per element of what a norm keeps where that is not its input's dtype (torch's composite
        CPU norm keeps fp32 copies of a 16-bit input: 4); None: the input's (the residual stream's, or the compute
        dtype for q/k norms).
    autocast: 16-bit compute over fp32 parameters (every linear casts its input and weight).
    attention: the attention kernel ("flash", "sdpa", "cpu_blocked").
    packed_documents: rows pack several documents (data.pack_sample_into_one False): attention needs masks.
    repeat_kv: SDPA under a document mask repeats grouped-query k/v to the query heads (CUDA: its mask-taking
        kernel takes no fewer k/v heads, see attention.sdpa_attention), and keeps the copies for backward.
    """

    seq_len: int
    compute_bytes: int
    residual_bytes: int
    norm_tensors: int
    autocast: bool
    attention: str
    packed_documents: bool
    repeat_kv: bool = False
    norm_bytes: Optional[int] = None


def _none(args: Any, ctx: ActivationContext) -> list[Term]:
    return []


def _uniform(args: Any) -> tuple[Any, ...]:
    return (args,) * args.num_layers


@dataclass(frozen=True)
class ModelCounts:
    """A family's analytic counts, each a function of its module args (and, for activations, the context).

    block(args): the parameters of one repeated block (the unit of FSDP, checkpointing and the pipeline split).
    embedding(args) / head(args): the parameters before the blocks (first pipeline stage) and after them (last).
    block_flops_per_token(args, seq_len): forward FLOPs of one block per token (what recomputation adds).
    block_activations(args, ctx): bytes per token one block keeps for backward.
    checkpointed_block_activations(args, ctx): bytes per token a recomputed (checkpointed) block keeps.
    shared_activations(args, ctx): bytes per token kept once per micro-batch (ids, rotary tables, masks).
    head_activations(args, ctx): bytes per token the head keeps (final norm, the output layer's input); the
        logits and what the loss keeps are the estimator's (from `logits`).
    logits(args): the logits' width per token (the vocabulary) and the mesh dimensions that split it.
    block_communication(args, ctx): bytes per token one block's own collectives move in a forward and backward
        (an MoE all-to-all), each term with the dimensions that divide it; none for dense families.
    selective_block_activations(args, ctx): bytes per token a block keeps under selective recomputation
        (model.checkpoint="selective": its input and the outputs of its matmuls, attention kernels and
        collectives, parallel/activation_checkpoint.SAVE_LIST); None: the family gives none, and the estimator
        counts such a block as keeping every activation (an upper bound, said in its notes).
    layer_args(args): the args each block's counts are called with, one per block in order (a stack of blocks
        of several kinds, e.g. dense blocks among MoE blocks: model/moe/mix.py); default `args` for every block.
    active_parameters(args): the parameters one token's forward multiplies, embedding row and head included (a
        mixture of experts: k of E experts; what its model card calls activated); None: the family says none.
    """

    block: Callable[[Any], Parameters]
    embedding: Callable[[Any], Parameters]
    head: Callable[[Any], Parameters]
    block_flops_per_token: Callable[[Any, int], float]
    block_activations: Callable[[Any, ActivationContext], list[Term]]
    checkpointed_block_activations: Callable[[Any, ActivationContext], list[Term]]
    shared_activations: Callable[[Any, ActivationContext], list[Term]]
    head_activations: Callable[[Any, ActivationContext], list[Term]]
    logits: Callable[[Any], Term]
    block_communication: Callable[[Any, ActivationContext], list[Term]] = _none
    selective_block_activations: Optional[Callable[[Any, ActivationContext], list[Term]]] = None
    layer_args: Callable[[Any], tuple[Any, ...]] = _uniform
    active_parameters: Optional[Callable[[Any], int]] = None


def keys_per_query(seq_len: int) -> float:
    """Mean number of keys a query of `blocked_causal_attention` scores (whole diagonal blocks included)."""
    return sum((min(s + CAUSAL_BLOCK, seq_len) - s) * min(s + CAUSAL_BLOCK, seq_len)
               for s in range(0, seq_len, CAUSAL_BLOCK)) / seq_len
