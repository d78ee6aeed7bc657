"""The real trainer under injected faults: inf/nan gradients are skipped and counted; K in a row stop the run."""

from pathlib import Path

import pytest
import torch

from internlm_core.config import load_config
from internlm_core.distributed import LaunchInfo
from internlm_core.errors import TrainingError
from internlm_core.trainer.build import build_trainer
from internlm_core.callbacks import TrainerCallback


class PoisonGradients(TrainerCallback):
    """After backward of the batches in `steps` (1-based), turn one gradient into NaN."""

    def __init__(self, trainer, steps):
        self.trainer, self.steps = trainer, set(steps)

    def on_after_backward(self, trainer):
        if self.trainer.state.batch_count in self.steps:
            p = next(self.trainer.model.parameters())
            p.grad.view(-1)[0] = float("nan")


def make_trainer(tmp_path: Path, *overrides: str):
    cfg = load_config("configs/tiny.py", ["data.total_steps=8", "data.valid_every=0", "monitor.tensorboard=False",
                                          "data.empty_cache_and_diag_interval=0", *overrides])
    launch = LaunchInfo("none", 0, 1, 0, torch.device("cpu"), None)
    return build_trainer(cfg, launch, tmp_path)


def test_nan_gradient_skips_update_and_training_continues(tmp_path):
    trainer = make_trainer(tmp_path, "monitor.max_consecutive_inf_nan=3")
    trainer.callbacks.add(PoisonGradients(trainer, {3, 5}))
    before = {}

    class Snapshot(TrainerCallback):
        def on_before_forward(self, t):
            if trainer.state.batch_count == 3 and not before:
                before.update({n: p.detach().clone() for n, p in trainer.model.named_parameters()})

    trainer.callbacks.add(Snapshot())
    steps = []

    class Record(TrainerCallback):
        def on_step_end(self, t, metrics):
            steps.append(metrics)
            if metrics["step"] == 3:  # the update of step 3 was skipped: weights are as before it
                for n, p in t.model.named_parameters():
                    assert torch.equal(p, before[n]), n

    trainer.callbacks.add(Record())
    state = trainer.train()
    assert state.batch_count == 8 and state.inf_nan_skip_batches == 2 and state.step_count == 6
    assert [m["skipped"] for m in steps] == [False, False, True, False, True, False, False, False]
    assert steps[-1]["inf_nan_skip_batches"] == 2
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_consecutive_nan_steps_stop_the_run(tmp_path):
    trainer = make_trainer(tmp_path, "monitor.max_consecutive_inf_nan=3")
    trainer.callbacks.add(PoisonGradients(trainer, {2, 3, 4, 5, 6}))
    with pytest.raises(TrainingError, match=r"inf/nan for 3 consecutive steps \(steps 2-4; "
                                            r"monitor.max_consecutive_inf_nan=3\)"):
        trainer.train()
    assert trainer.state.batch_count == 4 and trainer.state.inf_nan_skip_batches == 3
