"""Runs train.py's main with one injected fault, to test monitoring end to end.

    python tests/e2e/fault_driver.py FAULT STEP RANK -- <train.py arguments>

FAULT: "raise" (an exception in the step loop) or "stall" (sleep 8 s, for the hang watchdog),
injected after step STEP on rank RANK only.
"""

import sys
import time

import train
from internlm_core.callbacks import TrainerCallback


class Fault(TrainerCallback):
    def __init__(self, kind: str, step: int, rank: int):
        self.kind, self.step, self.rank = kind, step, rank

    def on_step_end(self, trainer, metrics):
        if metrics["step"] != self.step or trainer.rank != self.rank:
            return
        if self.kind == "raise":
            raise RuntimeError(f"injected failure on rank {trainer.rank} at step {self.step}")
        time.sleep(8)


if __name__ == "__main__":
    kind, step, rank, sep, *rest = sys.argv[1:]
    assert sep == "--", "usage: fault_driver.py FAULT STEP RANK -- ARGS"
    sys.exit(train.main(rest, extra_callbacks=[Fault(kind, int(step), int(rank))]))
