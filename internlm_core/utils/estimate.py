"""Analytic parameter and memory figures of a config (used by `train.py --dry-run`)."""

from __future__ import annotations

from ..config import Config
from ..model import ModelArgs, analytic_parameter_count, flops_per_token

_BYTES = {"torch.float32": 4, "torch.tf32": 4, "torch.bfloat16": 2, "torch.float16": 2}


def memory_per_device(cfg: Config, args: ModelArgs, world_size: int = 1) -> dict[str, float]:
    """Bytes per device for parameters, gradients and optimizer state under the config's layout.

    Parameters and gradients are fp32 master copies (compute casts to `model.dtype`); AdamW keeps two
    fp32 moments. Sharding divides them by tensor * pipeline * the zero1 shard size.
    """
    p = cfg.parallel
    dp = max(world_size // (p.tensor * p.pipeline), 1)
    shard = dp if p.zero1 <= 0 else min(p.zero1, dp)
    n = analytic_parameter_count(args) / (p.tensor * p.pipeline * shard)
    return {"parameters": 4 * n, "gradients": 4 * n, "optimizer": 8 * n}


def describe(cfg: Config, args: ModelArgs, world_size: int = 1) -> str:
    """Human-readable summary: parameter count, FLOPs per token, memory per device."""
    n = analytic_parameter_count(args)
    mem = memory_per_device(cfg, args, world_size)
    gib = 1024**3
    lines = [f"model {cfg.model_type}: {n:,} parameters ({n / 1e9:.3f} B)",
             f"FLOPs per token (6N + 12*L*h*s): {flops_per_token(args, cfg.data.seq_len) / 1e9:.2f} GFLOP",
             f"memory per device on {world_size} device(s), before activations:"]
    lines += [f"  {k:<11} {v / gib:8.2f} GiB" for k, v in mem.items()]
    lines.append(f"  {'total':<11} {sum(mem.values()) / gib:8.2f} GiB")
    return "\n".join(lines)
