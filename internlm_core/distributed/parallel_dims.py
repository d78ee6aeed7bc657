"""ParallelDims: the data / zero / tensor / pipeline layout from `parallel`, the dimensions a model family adds,
and the device mesh of them all."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..config.schema import ParallelConfig
from ..errors import ConfigError


@dataclass
class ParallelDims:
    """data parallel = world / (tensor * pipeline); within it, parameters and optimizer state are
    sharded over `dp_shard` ranks (InternLM's zero1: <=0 all of dp, 1 none, k groups of k) and
    replicated over `dp_replicate` = dp / dp_shard (HSDP).

    `extra`: ((name, size), ...) of the mesh dimensions a model family adds (model.MeshDim): each is carved out of
    `dp_shard` (dp_shard = dp_shard_rest * the product of their sizes), so every generic group keeps its ranks
    and meaning; only the modules the family shards over such a dimension see it."""

    world_size: int
    tp: int = 1
    pp: int = 1
    zero1: int = -1
    extra: tuple[tuple[str, int], ...] = ()
    mesh: Optional[DeviceMesh] = field(default=None, repr=False)
    _flat: dict = field(default_factory=dict, repr=False)  # flattened dimensions, kept here (torch asks for it)

    def __post_init__(self) -> None:
        if self.world_size % (self.tp * self.pp):
            raise ConfigError(f"world size {self.world_size} is not divisible by parallel.tensor * parallel.pipeline "
                              f"({self.tp} * {self.pp})")
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

    GENERIC = ("pp", "dp_replicate", "dp_shard", "dp_shard_rest", "tp", "dp", "pp_dp")

    @classmethod
    def from_config(cls, p: ParallelConfig, world_size: int, extra: tuple[tuple[str, int], ...] = ()
                    ) -> "ParallelDims":
        """The layout of `p`; `extra`: the family's own dimensions with their sizes (see `family_dims`)."""
        return cls(world_size=world_size, tp=p.tensor, pp=p.pipeline, zero1=p.zero1, extra=tuple(extra))

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
        return self.world_size // (self.tp * self.pp)

    @property
    def dp_shard(self) -> int:
        return self.dp if self.zero1 <= 0 else 1 if self.zero1 == 1 else self.zero1

    @property
    def dp_replicate(self) -> int:
        return self.dp // self.dp_shard

    def build_mesh(self, device_type: str) -> Optional[DeviceMesh]:
        """Mesh ("pp", "dp_replicate", "dp_shard", "tp"), rank = ((pp * dp_replicate + r) * dp_shard + s) * tp + t
        (tensor-parallel peers are neighbours: on one node under NCCL), with two flattened dimensions:
        "dp" (all data-parallel ranks) and "pp_dp" (data parallel x pipeline: the ranks whose losses and
        metrics together cover the global batch once, each tensor-parallel rank holding a copy).
        None for one process."""
        if self.world_size == 1 or not dist.is_initialized():
            return None
        if dist.get_world_size() != self.world_size:
            raise ConfigError(f"ParallelDims for world size {self.world_size}, but the process group has "
                              f"{dist.get_world_size()} ranks")
        if not self.extra:
            mesh = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard, self.tp),
                                    mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
            self._flat = {"dp": mesh["dp_replicate", "dp_shard"]._flatten("dp"),
                          "pp_dp": mesh["pp", "dp_replicate", "dp_shard"]._flatten("pp_dp")}
            self.mesh = mesh
            return mesh
        # the same ranks in the same order, dp_shard split into (dp_shard_rest, *the family's dimensions)
        names = tuple(n for n, _ in self.extra)
        mesh = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard_rest,
                                              *(s for _, s in self.extra), self.tp),
                                mesh_dim_names=("pp", "dp_replicate", "dp_shard_rest", *names, "tp"))
        self._flat = {"dp_shard": mesh[("dp_shard_rest", *names)]._flatten("dp_shard"),
                      "dp": mesh[("dp_replicate", "dp_shard_rest", *names)]._flatten("dp"),
                      "pp_dp": mesh[("pp", "dp_replicate", "dp_shard_rest", *names)]._flatten("pp_dp")}
        self.mesh = mesh
        return mesh

    def size(self, name: str) -> int:
        """The size of a family's dimension (1 when the layout does not have it)."""
        return dict(self.extra).get(name, 1)

    def submesh(self, name: str) -> DeviceMesh:
        """The mesh of one dimension ("pp", "dp_replicate", "dp_shard", "tp") or flattened one ("dp", "pp_dp")."""
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

    def group(self, name: str) -> Optional[dist.ProcessGroup]:
        """The process group of one mesh dimension ("dp", "tp", "pp", "pp_dp", ...); None for one process."""
        if self.mesh is None:
            return None
        return self.submesh(name).get_group()

    def describe(self) -> str:
        return (f"dp={self.dp} (shard {self.dp_shard} x replicate {self.dp_replicate}) tp={self.tp} pp={self.pp}"
                + "".join(f" {n}={s} (of dp_shard)" for n, s in self.extra)
                + (f" [rank: dp {self.dp_rank}, tp {self.tp_rank}, pp {self.pp_rank}]" if self.mesh is not None else ""))
