"""ParallelDims: the data / zero / tensor / pipeline / context layout from `parallel`, the dimensions a model
family adds, and the device mesh of them all."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..config.schema import ParallelConfig
from ..errors import ConfigError

# the flattened meshes: name -> what its ranks are. A mesh dimension joins those its declaration (`Axis.joins`)
# names; each is built from the dimensions that join it, in mesh order, and exists whatever their sizes (one that no
# dimension of the layout joins, dp_shard_rest_cp without a family's dimensions, does not exist).
FLATTENED = {
    "dp": "the data-parallel ranks: each reads its own rows (the loaders' ranks)",
    "dp_shard": "the sharded data-parallel ranks (a mesh dimension of its own unless a family carves dimensions out)",
    "dp_shard_cp": "the ranks FSDP shards parameters over: all that hold the same parameters, less the replicas",
    "dp_cp": "the ranks gradients are averaged over (the loss contract's D)",
    "pp_dp": "the ranks whose losses and metrics together cover the global batch once",
    "dp_shard_rest_cp": "the ranks FSDP shards the modules a family's dimension sharded over (experts): the sharded "
                        "data-parallel ranks its dimensions leave, x context (only with a family's dimensions)",
}
_DATA = ("dp", "dp_shard_cp", "dp_cp", "pp_dp")  # what a data-parallel shard dimension joins


@dataclass(frozen=True)
class Axis:
    """One declared dimension of the device mesh: its name, its size (1: off, still built) and the flattened
    meshes (FLATTENED) its ranks belong to."""

    name: str
    size: int
    joins: tuple[str, ...] = ()


@dataclass
class ParallelDims:
    """data parallel = world / (tensor * pipeline * context); within it, parameters and optimizer state are
    sharded over `dp_shard` ranks (InternLM's zero1: <=0 all of dp, 1 none, k groups of k) and
    replicated over `dp_replicate` = dp / dp_shard (HSDP).

    `cp`: context parallel (parallel.context.size), a generic dimension every attention family shares: the `cp`
    ranks of one group read the same rows (the loaders see `dp` ranks only) and each keeps its zigzag chunk of
    every sequence. Their parameters are the same, so FSDP shards over `dp_shard_cp` = dp_shard x cp and
    gradients are reduced over `dp_cp` = dp x cp; "pp_dp", the ranks whose losses and metrics together cover the
    global batch once, includes cp.

    `extra`: ((name, size), ...) of the mesh dimensions a model family adds (model.MeshDim): each is carved out of
    `dp_shard` (dp_shard = dp_shard_rest * the product of their sizes), so every generic group keeps its ranks
    and meaning; only the modules the family shards over such a dimension see it.

    Every dimension is declared (`axes`: name, size, the flattened meshes it joins) and built, with size 1 when
    off; every group, flattened ones included (`FLATTENED`), is derived from those declarations and always
    exists under its one name."""

    world_size: int
    tp: int = 1
    pp: int = 1
    zero1: int = -1
    cp: int = 1
    extra: tuple[tuple[str, int], ...] = ()
    mesh: Optional[DeviceMesh] = field(default=None, repr=False)
    _flat: dict = field(default_factory=dict, repr=False)  # flattened dimensions, kept here (torch asks for it)

    def __post_init__(self) -> None:
        if self.world_size % (self.tp * self.pp * self.cp):
            cp = (" * parallel.context.size", f" * {self.cp}") if self.cp > 1 else ("", "")
            raise ConfigError(f"world size {self.world_size} is not divisible by parallel.tensor * parallel.pipeline"
                              f"{cp[0]} ({self.tp} * {self.pp}{cp[1]})")
        if self.zero1 > 1 and self.dp % self.zero1:
            raise ConfigError(f"parallel.zero1 ({self.zero1}) must divide the data-parallel size ({self.dp})")
        for name, size in self.extra:
            if size < 1 or name in self.GENERIC:
                raise ConfigError(f"parallel dimension {name!r}: size {size} (a family's dimension needs a new "
                                  f"name and a size >= 1)")
        if self.dp_shard % self.extra_size:
            sizes = " * ".join(f"{n} {s}" for n, s in self.extra)
            raise ConfigError(f"the model family's parallel dimensions ({sizes}) must divide the sharded "
                              f"data-parallel size {self.dp_shard} (world {self.world_size} / (tensor {self.tp} * "
                              f"pipeline {self.pp}), zero1 {self.zero1}): they are carved out of it")

    GENERIC = ("pp", "dp_replicate", "dp_shard", "dp_shard_rest", "cp", "tp", *FLATTENED)

    @property
    def axes(self) -> tuple[Axis, ...]:
        """The mesh's dimensions in rank order (the last varies fastest), every one declared whatever its size:
        pipeline, data replicate, data shard, context, tensor; with a family's dimensions pipeline, data replicate,
        what is left of the data shard, context, the family's dimensions carved out of the data shard, tensor.
        Tensor-parallel peers are neighbours, then context peers (the family's, with a family's dimensions; on one
        node under NCCL)."""
        outer = (Axis("pp", self.pp, ("pp_dp",)), Axis("dp_replicate", self.dp_replicate, ("dp", "dp_cp", "pp_dp")))
        # context ranks read the same rows and hold the same parameters: FSDP shards over them, gradients and
        # losses are reduced over them, but they are not data-parallel ranks
        if not self.extra:
            return (*outer, Axis("dp_shard", self.dp_shard, _DATA),
                    Axis("cp", self.cp, ("dp_shard_cp", "dp_cp", "pp_dp")), Axis("tp", self.tp))
        # a family's dimension shards its modules (experts) over the other data ranks x context, "dp_shard_rest_cp":
        # one block of the mesh ahead of the family's dimensions (DTensor slices mesh dimensions in order only), so
        # the context axis comes before them here (with a family's dimension of size 1 or cp 1, the same ranks)
        return (*outer, Axis("dp_shard_rest", self.dp_shard_rest, ("dp_shard", "dp_shard_rest_cp", *_DATA)),
                Axis("cp", self.cp, ("dp_shard_cp", "dp_shard_rest_cp", "dp_cp", "pp_dp")),
                *(Axis(n, s, ("dp_shard", *_DATA)) for n, s in self.extra), Axis("tp", self.tp))

    def flattened(self) -> dict[str, tuple[str, ...]]:
        """{flattened mesh: the mesh dimensions it spans, in mesh order}, from the declarations (`axes`); a name
        that is a mesh dimension itself ("dp_shard" without a family's dimensions) is not flattened again."""
        axes, names = self.axes, {a.name for a in self.axes}
        joined = {flat: tuple(a.name for a in axes if flat in a.joins) for flat in FLATTENED if flat not in names}
        return {flat: dims for flat, dims in joined.items() if dims}  # dp_shard_rest_cp: a family's layout only

    def flat_size(self, name: str) -> int:
        """The number of ranks of a mesh dimension or flattened mesh (1 when the layout does not have it)."""
        sizes = {a.name: a.size for a in self.axes}
        if name in sizes:
            return sizes[name]
        n = 1
        for dim in self.flattened().get(name, ()):
            n *= sizes[dim]
        return n

    @classmethod
    def from_config(cls, p: ParallelConfig, world_size: int, extra: tuple[tuple[str, int], ...] = ()
                    ) -> "ParallelDims":
        """The layout of `p`; `extra`: the family's own dimensions with their sizes (see `family_dims`)."""
        return cls(world_size=world_size, tp=p.tensor, pp=p.pipeline, zero1=p.zero1, cp=p.context.size,
                   extra=tuple(extra))

    @property
    def extra_size(self) -> int:
        n = 1
        for _, size in self.extra:
            n *= size
        return n

    @property
    def dp_shard_rest(self) -> int:
        """The sharded data-parallel ranks left after the family's dimensions are carved out."""
        return self.dp_shard // self.extra_size

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each reads its own rows (context ranks share theirs)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def dp_cp(self) -> int:
        """The ranks gradients are reduced over (data x context parallel)."""
        return self.flat_size("dp_cp")

    @property
    def dp_shard_cp(self) -> int:
        """The ranks FSDP shards parameters over (the sharded data-parallel ranks x context parallel)."""
        return self.flat_size("dp_shard_cp")

    @property
    def pp_dp(self) -> int:
        """The ranks whose losses and metrics together cover the global batch once (pipeline x data x context)."""
        return self.flat_size("pp_dp")

    @property
    def dp_shard(self) -> int:
        return self.dp if self.zero1 <= 0 else 1 if self.zero1 == 1 else self.zero1

    @property
    def dp_replicate(self) -> int:
        return self.dp // self.dp_shard

    def build_mesh(self, device_type: str) -> Optional[DeviceMesh]:
        """The mesh of every declared dimension (`axes`: "pp", "dp_replicate", "dp_shard", "cp", "tp" -- or
        "dp_shard_rest", "cp", the family's own, "tp" --; size 1 when off), rank = (((pp * dp_replicate + r) *
        dp_shard + s) * cp + c) * tp + t without a family's dimensions, with every flattened mesh (FLATTENED: "dp",
        "pp_dp", "dp_shard_cp", "dp_cp" and, with a family's dimensions, "dp_shard" and "dp_shard_rest_cp"). The
        same ranks in the same order whatever the sizes. None for one process."""
        if self.world_size == 1 or not dist.is_initialized():
            return None
        if dist.get_world_size() != self.world_size:
            raise ConfigError(f"ParallelDims for world size {self.world_size}, but the process group has "
                              f"{dist.get_world_size()} ranks")
        axes = self.axes
        mesh = init_device_mesh(device_type, tuple(a.size for a in axes), mesh_dim_names=tuple(a.name for a in axes))
        self._flat = {name: mesh[dims]._flatten(name) for name, dims in self.flattened().items()}
        self.mesh = mesh
        return mesh

    # dimensions that came after the first checkpoints: a layout records them only when on (absent: 1)
    RECORDED_WHEN_ON = ("cp",)

    def record(self) -> dict[str, int]:
        """The layout a checkpoint's meta.json records (a resume with the same one is exact)."""
        return {"world_size": int(self.world_size), "dp": int(self.dp), "dp_shard": int(self.dp_shard),
                "dp_replicate": int(self.dp_replicate), "tp": int(self.tp), "pp": int(self.pp),
                "zero1": int(self.zero1),
                **{a.name: int(a.size) for a in self.axes if a.name in self.RECORDED_WHEN_ON and a.size > 1}}

    def size(self, name: str) -> int:
        """The size of a family's dimension (1 when the layout does not have it)."""
        return dict(self.extra).get(name, 1)

    def submesh(self, name: str) -> DeviceMesh:
        """The mesh of one declared dimension (`axes`: "pp", "dp_replicate", "dp_shard", "cp", "tp", a family's) or
        flattened one (FLATTENED: "dp", "pp_dp", "dp_shard_cp", "dp_cp"), whatever the sizes."""
        if self.mesh is None:
            raise ValueError("ParallelDims.submesh: no device mesh (one process, or build_mesh not called)")
        return self._flat[name] if name in self._flat else self.mesh[name]

    def _coord(self, name: str) -> tuple[int, int]:
        if self.mesh is None:
            return 0, 1
        sub = self.submesh(name)
        return sub.get_local_rank(), sub.size()

    @property
    def dp_rank(self) -> int:
        return self._coord("dp")[0]

    @property
    def tp_rank(self) -> int:
        return self._coord("tp")[0]

    @property
    def pp_rank(self) -> int:
        return self._coord("pp")[0]

    @property
    def cp_rank(self) -> int:
        return self._coord("cp")[0]

    def group(self, name: str) -> Optional[dist.ProcessGroup]:
        """The process group of one mesh dimension ("dp", "tp", "pp", "pp_dp", ...); None for one process."""
        if self.mesh is None:
            return None
        return self.submesh(name).get_group()

    def describe(self) -> str:
        return (f"dp={self.dp} (shard {self.dp_shard} x replicate {self.dp_replicate}) tp={self.tp} pp={self.pp}"
                + (f" cp={self.cp}" if self.cp > 1 else "")
                + "".join(f" {n}={s} (of dp_shard)" for n, s in self.extra)
                + (f" [rank: dp {self.dp_rank}, tp {self.tp_rank}, pp {self.pp_rank}"
                   + (f", cp {self.cp_rank}" if self.cp > 1 else "") + "]" if self.mesh is not None else ""))
