"""torchrun driver: train.py's main; each rank saves its own parameters at the start and at the end of training."""

import sys

import torch
from torch.distributed.tensor import DTensor, Shard

import train
from internlm_core.callbacks import TrainerCallback


def _whole_or_local(p):
    if not isinstance(p, DTensor):
        return p
    if any(isinstance(pl, Shard) for pl in p.placements):
        return p.full_tensor()
    return p.to_local()


class SaveLocalParameters(TrainerCallback):
    """`{prefix}.rank{R}.init.pt` before the first step, `{prefix}.rank{R}.pt` after the last."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def _save(self, trainer, suffix: str) -> None:
        # the rank's own copy: replicated DTensors give their local tensor, which each rank updated itself;
        # sharded ones (FSDP) are gathered whole (a collective: every rank saves)
        params = {n: _whole_or_local(p).detach().clone() for n, p in trainer.model.named_parameters()}
        torch.save(params, f"{self.prefix}.rank{trainer.rank}{suffix}.pt")

    def on_train_start(self, trainer):
        self._save(trainer, ".init")

    def on_train_end(self, trainer):
        self._save(trainer, "")


if __name__ == "__main__":
    sys.exit(train.main(sys.argv[2:], extra_callbacks=[SaveLocalParameters(sys.argv[1])]))
