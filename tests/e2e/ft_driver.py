"""train.py's main as one rank of a replica group (parallel.fault_tolerance), paced and fingerprinted for the tests.

    python tests/e2e/ft_driver.py PACE_TOGETHER PACE_ALONE DIE_AT[@RANK] -- <train.py arguments>

After every step the rank sleeps PACE_TOGETHER seconds while every replica group is in the quorum and PACE_ALONE
while some are missing (a lost group has time to come back before the run ends). DIE_AT > 0: the rank (every
rank, or only RANK) SIGKILLs itself right after the backward of its first step at or past DIE_AT, before the gradients go to the other
groups (its peers are then in that step's all-reduce with a group that is gone: the step cannot commit). At the
end it writes
`digest-rank{R}.json` into the run folder: the step reached and a sha256 of this rank's local shards of the model
and of the optimizer state, which two groups share bit for bit when they hold the same weights.
"""

import hashlib
import json
import os
import signal
import sys
import time

import torch
from torch.distributed.tensor import DTensor

import train
from internlm_core.callbacks import TrainerCallback


def _sha(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class PaceAndDigest(TrainerCallback):
    """An observer (callbacks see a read-only StepView); `replicas` (the trainer's replica groups, read for their
    size and heal count) is handed to it by `_watch_replicas` once train.py has built the trainer."""

    def __init__(self, together: float, alone: float, die_at: str):
        step, _, rank = die_at.partition("@")
        self.together, self.alone, self.die_at, self.die_rank = together, alone, int(step), rank
        self.replicas = None

    def on_after_backward(self, view):
        # >=: a group that joins late heals past die_at (a loaded machine starts it after the others moved on)
        if self.die_at and view.state.batch_count >= self.die_at and self.die_rank in ("", str(view.rank)):
            os.kill(os.getpid(), signal.SIGKILL)

    def on_step_end(self, view, metrics):
        full = metrics.get("ft/participants", 0) >= self.replicas.group_size
        time.sleep(self.together if full else self.alone)

    def on_train_end(self, view):
        optim = view.optimizer.state_dict()["state"]
        record = {"step": view.state.batch_count, "model": _sha(view.model.state_dict().values()),
                  "optimizer": _sha(v for i in sorted(optim) for _, v in sorted(optim[i].items())),
                  "heals": self.replicas.heal.healed}
        (view.run_dir / f"digest-rank{view.rank}.json").write_text(json.dumps(record))


def _watch_replicas(pace: PaceAndDigest) -> None:
    """train.py's build_trainer, then `pace.replicas` = the built trainer's replica groups."""
    from internlm_core.trainer import build

    real = build.build_trainer

    def build_trainer(*args, **kwargs):
        trainer = real(*args, **kwargs)
        pace.replicas = trainer.replicas
        return trainer

    build.build_trainer = build_trainer


if __name__ == "__main__":
    together, alone, die_at, sep, *rest = sys.argv[1:]
    assert sep == "--", "usage: ft_driver.py PACE_TOGETHER PACE_ALONE DIE_AT[@RANK] -- ARGS"
    pace = PaceAndDigest(float(together), float(alone), die_at)
    _watch_replicas(pace)
    sys.exit(train.main(rest, extra_callbacks=[pace]))
