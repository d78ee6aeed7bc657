"""Runs train.py's main with one injected fault, to test monitoring and recovery end to end.

    python tests/e2e/fault_driver.py FAULT STEP RANK -- <train.py arguments>

FAULT, injected after step STEP on rank RANK only:
  "raise"   an exception in the step loop;
  "stall"   sleep 8 s (for the hang watchdog's alert);
  "hang"    sleep an hour (for hang_action "exit": the watchdog must end it);
  "garbage:N"  from batch index STEP on, N batches of uniformly random tokens on every rank (RANK ignored): a
            region of garbage training data, for the spike rewind.

The first three are an observer (`Fault`, a callback); garbage data is not something an observer may do (callbacks
see a read-only view of the run): `inject_garbage` changes the trainer's loader, applied to the trainer that
train.py builds.
"""

import sys
import time

import torch

import train
from internlm_core.callbacks import TrainerCallback


def inject_garbage(trainer, first: int, n: int) -> None:
    """Batches `first` .. `first + n - 1` (0-based indices) of `trainer`'s loader become uniformly random tokens."""
    last = first + n
    loader, vocab = trainer.train_loader, trainer.loop.vocab_size
    real = loader.batch_at

    def batch_at(consumed):
        batch = real(consumed)
        if first <= consumed // loader.rows_per_step < last:  # the batch index this position starts
            g = torch.Generator().manual_seed(consumed)
            batch["input_ids"] = torch.randint(0, vocab, batch["input_ids"].shape, generator=g)
            labels = torch.randint(0, vocab, batch["labels"].shape, generator=g)
            batch["labels"] = torch.where(batch["labels"] < 0, batch["labels"], labels)
        return batch

    loader.batch_at = batch_at


class Fault(TrainerCallback):
    def __init__(self, kind: str, step: int, rank: int):
        self.kind, self.step, self.rank = kind, step, rank

    def on_step_end(self, view, metrics):
        if metrics["step"] != self.step or view.rank != self.rank:
            return
        if self.kind == "raise":
            raise RuntimeError(f"injected failure on rank {view.rank} at step {self.step}")
        if self.kind == "hang":
            time.sleep(3600)
        else:
            time.sleep(8)


def _with_garbage(first: int, n: int) -> None:
    """train.py's build_trainer, followed by inject_garbage on the trainer it builds."""
    from internlm_core.trainer import build

    real = build.build_trainer

    def build_trainer(*args, **kwargs):
        trainer = real(*args, **kwargs)
        inject_garbage(trainer, first, n)
        return trainer

    build.build_trainer = build_trainer


if __name__ == "__main__":
    kind, step, rank, sep, *rest = sys.argv[1:]
    assert sep == "--", "usage: fault_driver.py FAULT STEP RANK -- ARGS"
    if kind.startswith("garbage:"):
        _with_garbage(int(step), int(kind.split(":")[1]))
        sys.exit(train.main(rest))
    sys.exit(train.main(rest, extra_callbacks=[Fault(kind, int(step), int(rank))]))
