"""Build a model from the config through its family's spec."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .attention import default_attention_backend
from .init import materialize
from .spec import ModelSpec, get_model_spec


def model_spec(cfg: Any) -> ModelSpec:
    """The spec of `cfg.model_type`."""
    return get_model_spec(cfg.model_type)


def model_args_from_config(cfg: Any, device_type: str = "cpu", quiet: bool = False,
                           attn_backend: Optional[str] = None) -> Any:
    """The family's module args from the config. `attn_backend`: the attention kernel a run chose
    (numerics.select_kernels); without it the plain one of `device_type` (see default_attention_backend)."""
    return model_spec(cfg).build_args(cfg, attn_backend or default_attention_backend(device_type))


def build_model(cfg: Any, device: torch.device | str = "cpu", seed: Optional[int] = None,
                attn_backend: Optional[str] = None) -> torch.nn.Module:
    """The model of `cfg.model_type`: built on the meta device, then (unless `device` is "meta") materialized
    on `device` and initialized from `seed` (default `cfg.seed`) as every parallel layout initializes it.
    `attn_backend`: the run's attention kernel (see model_args_from_config)."""
    device = torch.device(device)
    args = model_args_from_config(cfg, "cuda" if device.type == "cuda" else device.type, attn_backend=attn_backend)
    with torch.device("meta"):
        model = model_spec(cfg).module(args)
    if device.type != "meta":
        materialize(model, device, cfg.seed if seed is None else seed)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def model_flops_per_token(cfg: Any, args: Any) -> int:
    """Model FLOPs per trained token of `cfg`'s family (0 when the family does not say)."""
    fn = model_spec(cfg).flops_per_token
    return int(fn(args, cfg.data.seq_len)) if fn is not None else 0
