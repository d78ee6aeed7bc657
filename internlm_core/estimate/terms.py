"""A family's counts (model/counts.py) on one device of a layout: terms divided by their mesh dimensions."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

from ..errors import ConfigError
from ..model.counts import Linear, ModelCounts, Parameters, Term
from ..model.mtp import mtp_counts
from .figures import Layout


def divisor(dims: tuple[str, ...], sizes: Mapping[str, int]) -> int:
    """The product of the sizes of `dims`; an error naming a dimension the layout does not have."""
    n = 1
    for d in dims:
        if d not in sizes:
            raise ConfigError(f"a model count is divided by mesh dimension {d!r}, which neither the generic layout "
                              f"nor the family's plan (ParallelPlan.mesh_dims) has: expected one of "
                              f"{', '.join(sizes)}")
        n *= sizes[d]
    return n


def _groups(terms: Iterable[Term]) -> dict[tuple[str, ...], float]:
    """Values summed by their dimensions, in order of first appearance (integer counts sum exactly)."""
    out: dict[tuple[str, ...], float] = {}
    for t in terms:
        out[t.shard] = out.get(t.shard, 0) + t.value
    return out


def per_device(terms: Iterable[Term], sizes: Mapping[str, int]) -> float:
    """What one device holds of `terms` (before any FSDP sharding)."""
    total = 0.0
    for dims, value in _groups(terms).items():
        total += value / divisor(dims, sizes)
    return total


def fsdp_share(terms: Iterable[Term], lay: Layout) -> float:
    """What one device keeps of `terms` under FSDP: each sharded over dp_shard, less the family's dimensions that
    divide it (they are carved out of the sharded data-parallel ranks)."""
    total = 0.0
    for dims, value in _groups(terms).items():
        carved = 1
        for d in dims:
            carved *= lay.dims.get(d, 1)
        total += value / divisor(dims, lay.sizes) / max(lay.dp_shard // carved, 1)
    return total


def scaled(terms: Iterable[Term], k: float) -> list[Term]:
    return [Term(t.name, t.value * k, t.shard) for t in terms]


def matrices(linears: Iterable[Linear]) -> list[Term]:
    """The weights the matmuls multiply (tied ones included: each is cast where it is used)."""
    return [Term(w.name, w.elements, w.shard) for w in linears]


# A stack of blocks of several kinds (ModelCounts.layer_args: an MoE family's dense blocks, model/moe/mix.py) is
# counted as its mean block: every per-block figure the estimator multiplies by a stage's blocks (parameters,
# activations, FLOPs, collectives' bytes) is the mean over the stack's blocks, so L blocks give the stack's exact
# sum (under pipeline parallel the mean over the blocks of the rank holding the most parameters: its exact sum, an
# upper bound for the other ranks); the linears, whose shapes set peaks and kernels, are the largest block's. A
# stack of one kind is counted as before, term for term.
_BLOCK_FNS = ("block_activations", "checkpointed_block_activations", "block_communication",
              "selective_block_activations")


def block_kinds(counts: ModelCounts, args: Any, lay: Layout) -> list[tuple[Any, float]]:
    """(args, share of the blocks) of each kind of block, in order of first appearance: of the whole stack, or
    under pipeline parallel of the pipeline rank whose blocks (its stages' equal contiguous runs,
    model/parallel_styles.stage_layers) hold the most parameters."""
    layers = list(counts.layer_args(args))
    stages = lay.pp * lay.num_chunks
    if stages > 1 and len(layers) % stages == 0 and len({id(a) for a in layers}) > 1:
        per = len(layers) // stages
        ranks = [[a for s in range(r, stages, lay.pp) for a in layers[s * per:(s + 1) * per]] for r in range(lay.pp)]
        size = {id(a): counts.block(a).count for a in layers}
        layers = max(ranks, key=lambda held: sum(size[id(a)] for a in held))
    seen: dict[int, list] = {}
    for a in layers:
        seen.setdefault(id(a), [a, 0])[1] += 1
    return [(a, n / len(layers)) for a, n in seen.values()]


def mean_terms(kinds: list[tuple[Any, float]], fn: Any) -> list[Term]:
    """`fn(args)`'s terms of the stack's mean block (one kind: its own terms, unscaled)."""
    if len(kinds) == 1:
        return list(fn(kinds[0][0]))
    return [t for a, share in kinds for t in scaled(fn(a), share)]


def stack_mean(counts: ModelCounts, kinds: list[tuple[Any, float]]) -> ModelCounts:
    """`counts` whose per-block functions (activations, collectives, FLOPs) give the mean block of a stack of
    `kinds` whatever args they are called with; `counts` itself for a stack of one kind."""
    if len(kinds) == 1:
        return counts

    def mean(fn: Any) -> Any:
        return lambda _args, ctx: mean_terms(kinds, lambda a: fn(a, ctx))
    fns = {name: mean(getattr(counts, name)) for name in _BLOCK_FNS if getattr(counts, name, None) is not None}
    flops = counts.block_flops_per_token
    return replace(counts, **fns, block_flops_per_token=lambda _args, seq_len: sum(
        share * flops(a, seq_len) for a, share in kinds))


@dataclass(frozen=True)
class ModelFigures:
    """A family's counts resolved for one layout. Parameter terms are global counts; `*_local` are per device
    (tensor-parallel shards, the family's dimensions), before FSDP sharding."""

    counts: ModelCounts
    block: Parameters
    embedding: Parameters
    head: Parameters
    total: int
    block_flops_per_token: float
    block_local: float
    embedding_local: float
    head_local: float
    block_matrices_local: float
    head_matrices_local: float
    block_terms: tuple[Term, ...] = ()  # the mean block's parameter terms (stack_mean); () : block.terms()
    largest_block_local: float = 0.0  # the largest block's, per device (a stack of several kinds of blocks)

    @classmethod
    def resolve(cls, spec: Any, args: Any, lay: Layout, seq_len: int) -> "ModelFigures":
        if spec.counts is None:
            raise ConfigError(f"model_type {spec.name}: the family gives no counts (ModelSpec.counts), so it "
                              f"cannot be estimated")
        counts = mtp_counts(spec.counts)  # model.mtp's depths on the head side (none without depths)
        kinds = block_kinds(counts, args, lay)
        counts = stack_mean(counts, kinds)
        # the linears (shapes, kernels, peaks): the largest block's; the sums: the stack's mean block
        block = max((counts.block(a) for a, _ in kinds), key=lambda p: p.count)
        embedding, head = counts.embedding(args), counts.head(args)
        terms = mean_terms(kinds, lambda a: counts.block(a).terms())
        weights = mean_terms(kinds, lambda a: matrices(counts.block(a).linears))
        total = spec.num_parameters(args) if spec.num_parameters is not None else \
            sum(counts.block(a).count for a in counts.layer_args(args)) + embedding.count + head.count
        s = lay.sizes
        return cls(counts, block, embedding, head, int(total), float(counts.block_flops_per_token(args, seq_len)),
                   per_device(terms, s), per_device(embedding.terms(), s), per_device(head.terms(), s),
                   per_device(weights, s), per_device(matrices(head.linears), s), tuple(terms),
                   per_device(block.terms(), s))

    def stage_parameters(self, layers: int, first: bool, last: bool) -> list[Term]:
        """The parameter terms of a pipeline stage with `layers` blocks (the embedding on the first, the head on
        the last): `layers` of the stack's mean block (stack_mean)."""
        return scaled(list(self.block_terms) or self.block.terms(), layers) + \
            (self.embedding.terms() if first else []) + (self.head.terms() if last else [])

    def local_linears(self, lay: Layout, head: bool) -> list[tuple[float, float]]:
        """(out, in) on one device of every linear of a block, or of the head."""
        return [w.local_shape(divisor(w.shard, lay.sizes)) for w in (self.head if head else self.block).linears]
