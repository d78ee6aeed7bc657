"""AdamW with decay / no-decay groups: torch's fused kernel where supported, apex FusedAdam on request."""

from __future__ import annotations

import importlib.util

import torch

from ..config.schema import AdamConfig
from ..errors import ConfigError
from ..utils.logging import get_logger

logger = get_logger(__name__)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Matrices decay; norms, biases and other 1-D parameters do not (as InternLM and HF do)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in groups if g["params"]]


def select_adam_impl(requested: str, device_type: str, apex_installed: bool | None = None) -> str:
    """"apex" (NVIDIA FusedAdam), "fused" (torch fused) or "foreach"; `requested` is adam.fused."""
    if apex_installed is None:
        apex_installed = importlib.util.find_spec("apex") is not None and _is_nvidia_apex()
    if requested == "apex":
        if not apex_installed or device_type != "cuda":
            why = "NVIDIA apex is not installed" if not apex_installed else f"device is {device_type}, not cuda"
            raise ConfigError(f"adam.fused: 'apex' requested but {why}; use 'auto' or 'torch'")
        return "apex"
    if requested == "auto" and apex_installed and device_type == "cuda":
        return "apex"
    # torch's fused AdamW runs on CUDA and (since 2.4) CPU; foreach is the portable fallback
    return "fused" if device_type in ("cuda", "cpu") else "foreach"


def _is_nvidia_apex() -> bool:
    """The PyPI package named apex is an unrelated web toolkit: check for NVIDIA's optimizers."""
    return importlib.util.find_spec("apex.optimizers") is not None


def build_optimizer(model: torch.nn.Module, cfg: AdamConfig, device_type: str) -> torch.optim.Optimizer:
    """AdamW over the model's parameter groups."""
    groups = param_groups(model, cfg.weight_decay)
    impl = select_adam_impl(cfg.fused, device_type)
    kwargs = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    if impl == "apex":
        from apex.optimizers import FusedAdam
        opt = FusedAdam(groups, adam_w_mode=True, **kwargs)
    else:
        opt = torch.optim.AdamW(groups, fused=impl == "fused", foreach=None if impl == "fused" else True, **kwargs)
    logger.info(f"optimizer: AdamW ({impl}), {sum(len(g['params']) for g in groups)} tensors in {len(groups)} groups")
    return opt
