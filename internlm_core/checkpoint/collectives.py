"""The checkpoint's own process group: a dedicated gloo group (never the training's groups) and the few collectives
saving and loading need, each a no-op in a single process."""

from __future__ import annotations

import datetime
from typing import Any, Callable

import torch.distributed as dist

from ..errors import CheckpointError
from ..utils import collectives


class Collectives:
    """This process in the job (rank, world_size, local_rank: its index on its node) and its checkpoint group.

    Every method is a collective: all ranks call it, in the same order.
    """

    def __init__(self, rank: int = 0, world_size: int = 1, local_rank: int = 0, timeout_s: float = 3600.0):
        self.rank, self.world_size, self.local_rank = int(rank), int(world_size), int(local_rank)
        self.group: dist.ProcessGroup | None = None
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            # gloo for the checkpoint's own traffic; a simulated job (the fake backend) has no real peers to reach
            backend = None if dist.get_backend() == "fake" else "gloo"
            self.group = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))

    def all_gather(self, obj: Any) -> list:
        """Every rank's `obj`, in rank order."""
        if self.group is None:
            return [obj]
        out: list = [None] * self.world_size
        collectives.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """rank 0's `obj` on every rank."""
        if self.group is None:
            return obj
        box = [obj]
        collectives.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def agree(self, ok: bool, error: str) -> tuple[bool, str]:
        """All ranks learn whether every rank succeeded, and what failed where."""
        res = self.all_gather((ok, error))
        bad = [f"rank {r}: {e}" for r, (o, e) in enumerate(res) if not o]
        return not bad, "; ".join(bad)

    def barrier(self) -> None:
        if self.group is not None:
            collectives.barrier(group=self.group)

    def on_rank0(self, fn: Callable[[], Any]) -> Any:
        """fn() on rank 0, its value (or its error, as a CheckpointError) on every rank."""
        value: Any = None
        if self.rank == 0:
            try:
                value = ("ok", fn())
            except Exception as e:
                value = ("error", str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}")
        status, payload = self.broadcast(value)
        if status == "error":
            raise CheckpointError(payload)
        return payload

    def dcp_kwargs(self) -> dict:
        """The process-group arguments of `dcp.save` / `dcp.load` / `dcp.async_save`."""
        if self.group is not None:
            return {"process_group": self.group}
        return {"no_dist": not (dist.is_available() and dist.is_initialized())}
