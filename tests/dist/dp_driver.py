"""torchrun driver: train configs/tiny.py like train.py, then save this rank's parameters for comparison."""

import sys

import torch
from torch.distributed.tensor import DTensor

import train
from internlm_core.config import load_config
from internlm_core.distributed import destroy_distributed, init_distributed
from internlm_core.trainer.build import build_trainer, resolve_run_dir
from internlm_core.utils.logging import setup_logging


def main(out_prefix: str, argv: list[str]) -> None:
    args = train.parse_args(argv)
    launch = init_distributed(args.launcher)
    cfg = load_config(args.config, args.set, world_size=launch.world_size)
    run_dir = resolve_run_dir(cfg, args.run_dir, launch)
    setup_logging(launch.rank, run_dir)
    trainer = build_trainer(cfg, launch, run_dir)
    trainer.train()
    # the rank's own copy: replicated DTensors give their local tensor, which each rank updated itself
    params = {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in trainer.model.named_parameters()}
    torch.save(params, f"{out_prefix}.rank{launch.rank}.pt")
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
