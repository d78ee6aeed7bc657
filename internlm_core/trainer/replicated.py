"""The loop of one replica group under `parallel.fault_tolerance` (torchft; parallel/fault_tolerance.py).

`ReplicatedTrainer` is the Trainer with three additions, each at the point torchft needs it:

- before each batch, the step's quorum; a group that is behind heals from a live peer there (its progress, data
  position and weights become the peer's), so the batch it then reads is the one its peers read next;
- in the optimizer step, the gradients averaged over the groups of the quorum and the group's commit vote, before
  clipping (every group clips the same averaged gradient); a step the groups do not commit raises
  StepNotCommitted, which the loop answers by training the same batch again under a new quorum: the batch a lost
  group would have read at that step is not trained by anyone (torchft commits a step with its participants);
- the quorum's `ft/...` values in every step's metrics.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from ..config import Config
from ..distributed import LaunchInfo
from ..parallel.fault_tolerance import HealState, ReplicaGroups, StepNotCommitted, build_replica_groups
from ..utils.logging import get_logger
from .state import TrainState
from .trainer import Trainer

logger = get_logger(__name__)

# registered Statefuls a healing group keeps its own of: each group logs to its own tracker runs
NOT_HEALED = ("trackers",)


@dataclass
class ReplicatedTrainer(Trainer):
    """A Trainer that is one replica group of several (built by `build_trainer` when the section is enabled)."""

    replicas: Optional[ReplicaGroups] = None
    _redo: bool = False  # the last step was not committed: its batch comes again

    def _batches(self) -> Iterator[dict]:
        """The training batches, each after its step's quorum; a step that was not committed is rewound first (the
        loop's progress and the loader's position as they were before its batch), so its batch comes again."""
        batches = iter(self.train_loader)
        while True:
            self.replicas.begin_step()  # may heal: the state, data position and weights become a live peer's
            progress, position = self.state.state_dict(), self.train_loader.state_dict()
            yield next(batches)
            if self._redo:
                self._redo = False
                self.state.load_state_dict(progress)
                self.train_loader.load_state_dict(position)
                self.train_metric.reset()  # the attempt's micro-batches count again when the batch is trained again
                self.timers.pop()

    def optimizer_step(self) -> tuple[bool, float]:
        """The gradients averaged over the replica groups and the group's commit vote, then the usual clip and
        step; StepNotCommitted (gradients dropped) when the groups did not commit."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.replicas.average_gradients(params)
        if not self.replicas.commit():
            self.optimizer.zero_grad(set_to_none=True)
            self._redo = True
            logger.warning(f"replica group {self.replicas.replica_id}: step {self.state.batch_count} not committed "
                           f"({self.replicas.error}); training it again")
            raise StepNotCommitted(f"step {self.state.batch_count} of replica group {self.replicas.replica_id}")
        return super().optimizer_step()

    def train(self) -> TrainState:
        """Trainer.train; then this group leaves the quorum at once (its peers need not wait for its heartbeat to
        stop)."""
        try:
            return super().train()
        finally:
            self.replicas.close()

    def train_step(self, batch: dict, t_start: float) -> dict:
        """Trainer.train_step, with this step's quorum in its metrics (ft/participants, ft/quorum_time, ...)."""
        metrics = super().train_step(batch, t_start)
        metrics.update(self.replicas.step_metrics())
        return metrics


def trainer_class(replicas: Optional[ReplicaGroups]) -> Callable[..., Trainer]:
    """Trainer, or a ReplicatedTrainer bound to `replicas` when there are replica groups."""
    return Trainer if replicas is None else functools.partial(ReplicatedTrainer, replicas=replicas)


def build_replicas(cfg: Config, launch: LaunchInfo, ckpt: Any, state: TrainState) -> Optional[ReplicaGroups]:
    """This rank's part of the replica groups (None unless `parallel.fault_tolerance.enable`), after the resume: a
    healing group receives what a checkpoint holds (the manager's registry: model, optimizer, every Stateful)."""
    if not cfg.parallel.fault_tolerance.enable or launch.launcher == "simulate":
        return None  # a simulated rank (train.py --simulate) has no peers to meet
    statefuls = {name: entry.obj for name, entry in ckpt.state.entries.items() if name not in NOT_HEALED}
    heal = HealState(ckpt.state.model, ckpt.state.optimizer, statefuls)
    return build_replica_groups(cfg.parallel.fault_tolerance, launch.rank, launch.world_size, launch.device, heal,
                                step=state.batch_count)
