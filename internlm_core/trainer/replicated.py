"""The steps of one replica group under `parallel.fault_tolerance` (torchft; parallel/fault_tolerance.py): the
parts of `Trainer.train` that exist only with replica groups, each called by the loop at the point torchft needs it:

- before each batch, `begin_step`: the step's quorum; a group that is behind heals from a live peer there (its
  progress, data position and weights become the peer's), so the batch it then reads is the one its peers read
  next; the heal is logged with the step it went from and to, and written as a `heal` record into metrics.jsonl;
  it returns the `Attempt` (progress and data position before the batch) that a retry restores;
- before the optimizer step, `commit`: the gradients averaged over the groups of the quorum and the group's commit
  vote, before clipping (every group clips the same averaged gradient); a step the groups do not commit has its
  gradients dropped and the loop trains the same batch again under a new quorum (`Attempt.restore`): the batch a
  lost group would have read at that step is not trained by anyone (torchft commits a step with its participants);
- the quorum's `ft/...` values in every step's metrics (`ReplicaGroups.step_metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..checkpoint import CheckpointManager, RNGState
from ..config import Config
from ..distributed import LaunchInfo
from ..parallel.fault_tolerance import HealState, ReplicaGroups, build_replica_groups
from ..utils.logging import get_logger
from ..utils.writer import MetricsWriter
from .parts import TrainLoader
from .state import TrainState

logger = get_logger(__name__)

# registered Statefuls a healing group keeps its own of: each group logs to its own tracker runs
NOT_HEALED = ("trackers",)


@dataclass(frozen=True)
class Attempt:
    """The loop's progress, the loader's position and the random generators before a step's batch: what a retried
    step goes back to (a router's noise, e.g. moe.noisy_gate_policy, draws again what the dropped attempt drew)."""

    progress: dict
    position: dict
    rng: dict

    def restore(self, state: TrainState, loader: TrainLoader) -> None:
        """Back to before the batch, so that the same batch comes again, with the same random draws."""
        state.load_state_dict(self.progress)
        loader.load_state_dict(self.position)
        RNGState().load_state_dict(self.rng)


def begin_step(replicas: ReplicaGroups, state: TrainState, loader: TrainLoader, writer: MetricsWriter) -> Attempt:
    """The step's quorum (may heal: the state, data position and weights become a live peer's); the attempt."""
    before = state.batch_count
    if replicas.begin_step():
        record_heal(replicas, writer, before, state.batch_count)
    return Attempt(state.state_dict(), loader.state_dict(), RNGState().state_dict())


def record_heal(replicas: ReplicaGroups, writer: MetricsWriter, before: int, after: int) -> None:
    """Say what a heal did, in every rank's log and in metrics.jsonl (a `heal` record at the step the group
    continues from): the group's own progress (step `before`: a fresh start, or the checkpoint it resumed) was
    replaced by a live peer's, and the steps between were trained by the live groups, not by this one (a group
    that heals at its start has no train records up to the step it healed to)."""
    span = (f"; steps {before + 1}-{after} were trained by the live groups, not by this one"
            if after > before else "")
    logger.warning(f"replica group {replicas.replica_id}: healed from a live peer at its step {before}: "
                   f"continues from step {after}{span}")
    writer.write(after, {"replica_id": replicas.replica_id, "from_step": before, "to_step": after,
                         "heals": replicas.step_metrics().get("ft/heals", 0)}, kind="heal")


def commit(replicas: ReplicaGroups, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> bool:
    """The gradients averaged over the replica groups and the group's commit vote; False (gradients dropped) when
    the groups did not commit step `step`."""
    params = [p for p in model.parameters() if p.requires_grad]
    replicas.average_gradients(params)
    if replicas.commit():
        return True
    optimizer.zero_grad(set_to_none=True)
    logger.warning(f"replica group {replicas.replica_id}: step {step} not committed ({replicas.error}); training "
                   "it again")
    return False


def build_replicas(cfg: Config, launch: LaunchInfo, ckpt: CheckpointManager, state: TrainState) -> Optional[ReplicaGroups]:
    """This rank's part of the replica groups (None unless `parallel.fault_tolerance.enable`), after the resume: a
    healing group receives what a checkpoint holds (the manager's registry: model, optimizer, every Stateful)."""
    if not cfg.parallel.fault_tolerance.enable or launch.launcher == "simulate":
        return None  # a simulated rank (train.py --simulate) has no peers to meet
    statefuls = {name: entry.obj for name, entry in ckpt.state.entries.items() if name not in NOT_HEALED}
    heal = HealState(ckpt.state.model, ckpt.state.optimizer, statefuls)
    return build_replica_groups(cfg.parallel.fault_tolerance, launch.rank, launch.world_size, launch.device, heal,
                                step=state.batch_count)
