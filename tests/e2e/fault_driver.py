"""Runs train.py's main with one injected fault, to test monitoring and recovery end to end.

    python tests/e2e/fault_driver.py FAULT STEP RANK -- <train.py arguments>

FAULT, injected after step STEP on rank RANK only:
  "raise"   an exception in the step loop;
  "stall"   sleep 8 s (for the hang watchdog's alert);
  "hang"    sleep an hour (for hang_action "exit": the watchdog must end it);
  "garbage:N"  from batch index STEP on, N batches of uniformly random tokens on every rank (RANK ignored): a
            region of garbage training data, for the spike rewind.
"""

import sys
import time

import torch

import train
from internlm_core.callbacks import TrainerCallback


class Fault(TrainerCallback):
    def __init__(self, kind: str, step: int, rank: int):
        self.kind, self.step, self.rank = kind, step, rank

    def on_train_start(self, trainer):
        if not self.kind.startswith("garbage:"):
            return
        first, last = self.step, self.step + int(self.kind.split(":")[1])
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

    def on_step_end(self, trainer, metrics):
        if self.kind.startswith("garbage:") or metrics["step"] != self.step or trainer.rank != self.rank:
            return
        if self.kind == "raise":
            raise RuntimeError(f"injected failure on rank {trainer.rank} at step {self.step}")
        if self.kind == "hang":
            time.sleep(3600)
        else:
            time.sleep(8)


if __name__ == "__main__":
    kind, step, rank, sep, *rest = sys.argv[1:]
    assert sep == "--", "usage: fault_driver.py FAULT STEP RANK -- ARGS"
    sys.exit(train.main(rest, extra_callbacks=[Fault(kind, int(step), int(rank))]))
