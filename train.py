"""internlm-core training entry point: wiring only.

    python train.py --config configs/tiny.py                    # one process
    torchrun --nproc_per_node 2 train.py --config configs/tiny.py
    srun python train.py --config configs/7B.py --launcher slurm
"""

from __future__ import annotations

import argparse
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Pretrain a language model from a config in InternLM's format.")
    p.add_argument("--config", required=True, help="Python (.py) or YAML config file")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", action="extend",
                   help="override config keys, e.g. --set data.total_steps=20 model.num_layers=2 (repeatable: "
                        "every --set counts, later ones win for the same key)")
    p.add_argument("--launcher", choices=["torch", "slurm"], default=None,
                   help="how the processes were started (default: detect from the environment)")
    p.add_argument("--seed", type=int, default=None, help="seed (default: the config's `seed`)")
    p.add_argument("--run-dir", default=None, help="folder for everything this run writes "
                                                   "(default RUN/{JOB_NAME}/{launch_time})")
    p.add_argument("--dry-run", action="store_true",
                   help="check the config and what a run reads before its first step (data files, evaluation "
                        "tasks), build the model on the meta device, print its size and memory, and exit")
    p.add_argument("--profiling", action="store_true", help="run torch.profiler on a schedule (traces in the run folder)")
    p.add_argument("--dist-timeout", type=float, default=600.0, help="seconds before a stuck collective fails")
    p.add_argument("--simulate", type=int, default=None, metavar="WORLD_SIZE",
                   help="run as one rank of a WORLD_SIZE-rank job on this CPU (fake collectives): per-rank memory")
    p.add_argument("--simulate-rank", type=int, default=0, metavar="R", help="the rank --simulate runs (default 0)")
    p.add_argument("--simulate-device", choices=["cpu", "cuda"], default="cpu",
                   help="where --simulate runs its rank: this CPU (default) or this machine's GPU")
    p.add_argument("--force", action="store_true",
                   help="run even when the estimated memory exceeds what is free (memory_check=\"warn\": warn only)")
    return p.parse_args(argv)


def main(argv=None, extra_callbacks=None) -> int:
    """Run training; `extra_callbacks` (TrainerCallback objects) let a driver script observe the run (a StepView per
    event) and ask for a save or a stop of the current step (`view.requests`)."""
    args = parse_args(argv)
    from internlm_core.config import load_config
    from internlm_core.distributed import destroy_distributed, init_distributed
    from internlm_core.utils.logging import setup_logging

    if args.dry_run:
        from internlm_core.model import build_model, count_parameters, model_args_from_config
        from internlm_core.estimate import describe
        from internlm_core.config.loader import compat_lines
        from internlm_core.trainer.preflight import preflight
        cfg = load_config(args.config, args.set)
        for line in compat_lines(cfg):  # InternLM/InternEvo keys kept for compatibility, forms translated
            print(f"note: {line}")
        for line in preflight(cfg):  # what the run reads before its first step: data files, evaluation tasks
            print(f"checked: {line}")
        n = count_parameters(build_model(cfg, "meta"))
        print(describe(cfg, model_args_from_config(cfg)))
        print(f"built on the meta device: {n:,} parameters")
        return 0

    if args.simulate is not None:
        from internlm_core.trainer.simulate import simulate
        cfg = load_config(args.config, args.set, world_size=args.simulate)
        run_dir = Path(args.run_dir or f"RUN/{cfg.JOB_NAME}/simulate-{args.simulate}-rank{args.simulate_rank}")
        run_dir.mkdir(parents=True, exist_ok=True)
        setup_logging(args.simulate_rank, run_dir)
        simulate(cfg, args.simulate, args.simulate_rank, run_dir, seed=args.seed, device_type=args.simulate_device)
        destroy_distributed()
        return 0

    launch = init_distributed(args.launcher, timeout_s=args.dist_timeout)
    cfg = load_config(args.config, args.set, world_size=launch.world_size)
    if args.force:  # the memory check before materializing warns instead of refusing (estimate/fit.py)
        cfg.memory_check = "warn" if cfg.memory_check == "refuse" else cfg.memory_check
    from internlm_core.trainer.build import build_trainer, resolve_run_dir
    run_dir = resolve_run_dir(cfg, args.run_dir, launch)
    setup_logging(launch.rank, run_dir)
    from internlm_core.monitor import ExceptionMonitor, build_alert_manager
    alerts = build_alert_manager(cfg.monitor, cfg.JOB_NAME, launch.rank)
    # the monitor reports any failure (crash report, alert) and ends every rank instead of leaving peers hanging
    with ExceptionMonitor(alerts, launch.rank, run_dir, cfg.JOB_NAME, launch.world_size):
        trainer = build_trainer(cfg, launch, run_dir, seed=args.seed, alerts=alerts, profiling=args.profiling,
                                extra_callbacks=extra_callbacks)
        trainer.train()
    alerts.close(timeout=10)
    destroy_distributed()
    return 0


if __name__ == "__main__":
    from internlm_core.utils.cli import run_main

    run_main(main)
