"""torchrun driver: train.py's main, then each rank saves its own parameters for comparison."""

import sys

import torch
from torch.distributed.tensor import DTensor

import train
from internlm_core.callbacks import TrainerCallback


class SaveLocalParameters(TrainerCallback):
    def __init__(self, prefix: str):
        self.prefix = prefix

    def on_train_end(self, trainer):
        # the rank's own copy: replicated DTensors give their local tensor, which each rank updated itself
        params = {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
                  for n, p in trainer.model.named_parameters()}
        torch.save(params, f"{self.prefix}.rank{trainer.rank}.pt")


if __name__ == "__main__":
    sys.exit(train.main(sys.argv[2:], extra_callbacks=[SaveLocalParameters(sys.argv[1])]))
