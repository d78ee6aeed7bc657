"""The step loop lets go of each micro-batch's outputs before the next forward: with micro_num > 1 a second
[B, T, V] logits buffer alive during the next forward was ~0.85 GB more at the peak for 7B (issue 27, item 5)."""

import weakref
from pathlib import Path

import torch

from internlm_core.callbacks import TrainerCallback
from internlm_core.config import load_config
from internlm_core.distributed import LaunchInfo
from internlm_core.trainer.build import build_trainer


class WatchLogits(TrainerCallback):
    """Keeps weak references to each micro-batch's logits and side results; at each forward records which of the
    previous micro-batch's are still alive."""

    def __init__(self):
        self.previous: list[weakref.ref] = []
        self.alive_at_forward: list[int] = []
        self.forwards = 0

    def on_micro_batch_end(self, trainer, logits, labels, type_ids, token_losses, predictions):
        self.previous = [weakref.ref(t) for t in (logits, token_losses, predictions) if t is not None]

    def on_before_forward(self, trainer):
        self.forwards += 1
        self.alive_at_forward.append(sum(ref() is not None for ref in self.previous))


def test_the_previous_micro_batch_outputs_are_released_before_the_next_forward(tmp_path: Path):
    cfg = load_config("configs/tiny.py", ["data.total_steps=2", "data.micro_num=3", "data.valid_every=0",
                                          "monitor.tensorboard=False", "data.empty_cache_and_diag_interval=0"])
    watch = WatchLogits()
    trainer = build_trainer(cfg, LaunchInfo("none", 0, 1, 0, torch.device("cpu"), None), tmp_path,
                            extra_callbacks=[watch])
    trainer.train()
    assert watch.forwards == 6 and watch.previous  # the references were taken
    assert watch.alive_at_forward == [0] * 6, watch.alive_at_forward
