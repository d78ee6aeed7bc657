"""A family's counts (model/counts.py) on one device of a layout: terms divided by their mesh dimensions."""

from __future__ import annotations

from dataclasses import dataclass
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

    @classmethod
    def resolve(cls, spec: Any, args: Any, lay: Layout, seq_len: int) -> "ModelFigures":
        if spec.counts is None:
            raise ConfigError(f"model_type {spec.name}: the family gives no counts (ModelSpec.counts), so it "
                              f"cannot be estimated")
        counts = mtp_counts(spec.counts)  # model.mtp's depths on the head side (none without depths)
        block, embedding, head = counts.block(args), counts.embedding(args), counts.head(args)
        total = spec.num_parameters(args) if spec.num_parameters is not None else \
            sum(counts.block(a).count for a in counts.layer_args(args)) + embedding.count + head.count
        s = lay.sizes
        return cls(counts, block, embedding, head, int(total), float(counts.block_flops_per_token(args, seq_len)),
                   per_device(block.terms(), s), per_device(embedding.terms(), s), per_device(head.terms(), s),
                   per_device(matrices(block.linears), s), per_device(matrices(head.linears), s))

    def stage_parameters(self, layers: int, first: bool, last: bool) -> list[Term]:
        """The parameter terms of a pipeline stage with `layers` blocks (the embedding on the first, the head on
        the last)."""
        return scaled(self.block.terms(), layers) + (self.embedding.terms() if first else []) \
            + (self.head.terms() if last else [])

    def local_linears(self, lay: Layout, head: bool) -> list[tuple[float, float]]:
        """(out, in) on one device of every linear of a block, or of the head."""
        return [w.local_shape(divisor(w.shard, lay.sizes)) for w in (self.head if head else self.block).linears]
