"""ParallelDims: the data / zero / tensor / pipeline / context layout from `parallel`, the dimensions a model
family adds, and the device mesh of them all."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..config.schema import ParallelConfig
from ..errors import ConfigError


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
    and meaning; only the modules the family shards over such a dimension see it."""

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

    GENERIC = ("pp", "dp_replicate", "dp_shard", "dp_shard_rest", "cp", "tp", "dp", "pp_dp", "dp_shard_cp", "dp_cp")

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
        return self.dp * self.cp

    @property
    def dp_shard_cp(self) -> int:
        """The ranks FSDP shards parameters over (the sharded data-parallel ranks x context parallel)."""
        return self.dp_shard * self.cp

    @property
    def dp_shard(self) -> int:
        return self.dp if self.zero1 <= 0 else 1 if self.zero1 == 1 else self.zero1

    @property
    def dp_replicate(self) -> int:
        return self.dp // self.dp_shard

    def build_mesh(self, device_type: str) -> Optional[DeviceMesh]:
        """Mesh ("pp", "dp_replicate", "dp_shard", ["cp",] "tp"), rank = (((pp * dp_replicate + r) * dp_shard + s)
        * cp + c) * tp + t (tensor-parallel peers are neighbours, then context peers: on one node under NCCL), with
        flattened dimensions: "dp" (all data-parallel ranks), "pp_dp" (pipeline x data x context parallel: the ranks
        whose losses and metrics together cover the global batch once, each tensor-parallel rank holding a copy)
        and, under context parallel, "dp_shard_cp" and "dp_cp" (what FSDP shards and reduces over). A family's own
        dimensions split "dp_shard" into ("dp_shard_rest", *theirs). None for one process."""
        if self.world_size == 1 or not dist.is_initialized():
            return None
        if dist.get_world_size() != self.world_size:
            raise ConfigError(f"ParallelDims for world size {self.world_size}, but the process group has "
                              f"{dist.get_world_size()} ranks")
        # the same ranks in the same order whatever the split of dp_shard (the family's dimensions carved out of it)
        names = tuple(n for n, _ in self.extra)
        shard = ("dp_shard_rest", *names) if self.extra else ("dp_shard",)
        shard_sizes = (self.dp_shard_rest, *(s for _, s in self.extra)) if self.extra else (self.dp_shard,)
        cp = ("cp",) if self.cp > 1 else ()
        mesh = init_device_mesh(device_type, (self.pp, self.dp_replicate, *shard_sizes, *((self.cp,) if cp else ()),
                                              self.tp),
                                mesh_dim_names=("pp", "dp_replicate", *shard, *cp, "tp"))
        flat = {"dp": ("dp_replicate", *shard), "pp_dp": ("pp", "dp_replicate", *shard, *cp)}
        if self.extra:
            flat["dp_shard"] = shard
        if cp:
            flat.update(dp_shard_cp=(*shard, "cp"), dp_cp=("dp_replicate", *shard, "cp"))
        self._flat = {name: mesh[dims]._flatten(name) for name, dims in flat.items()}
        self.mesh = mesh
        return mesh

    def size(self, name: str) -> int:
        """The size of a family's dimension (1 when the layout does not have it)."""
        return dict(self.extra).get(name, 1)

    def submesh(self, name: str) -> DeviceMesh:
        """The mesh of one dimension ("pp", "dp_replicate", "dp_shard", "cp", "tp") or flattened one ("dp", "pp_dp",
        "dp_shard_cp", "dp_cp"; without context parallel the last two are "dp_shard" and "dp")."""
        if self.mesh is None:
            raise ValueError("ParallelDims.submesh: no device mesh (one process, or build_mesh not called)")
        if self.cp == 1 and name in ("dp_shard_cp", "dp_cp"):
            name = name[:-3]
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
        return self._coord("cp")[0] if self.cp > 1 else 0

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
