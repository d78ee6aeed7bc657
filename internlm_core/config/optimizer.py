"""The rules of the `optimizer` and `lr_scheduler` sections (schema.OptimizerConfig, schema.LRSchedulerConfig):
the values each key takes, and no key of one choice set while another is chosen (it would be ignored)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import ConfigError

LR_SCHEDULES = ("cosine", "wsd")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")
OPTIMIZERS = ("adamw", "muon")
NS_DTYPES = ("auto", "float32", "bfloat16")


def _set_keys(section: Any, prefix: str) -> list[str]:
    """The keys starting with `prefix` whose value differs from the default."""
    def default(fl: dataclasses.Field) -> Any:
        return fl.default_factory() if fl.default_factory is not dataclasses.MISSING else fl.default
    return [fl.name for fl in dataclasses.fields(section) if fl.name.startswith(prefix)
            and getattr(section, fl.name) != default(fl)]


def check_lr_scheduler(ls: Any) -> None:
    """name cosine or wsd; the wsd keys valid, and left at their defaults under cosine."""
    if ls.name not in LR_SCHEDULES:
        raise ConfigError(f"lr_scheduler.name: expected one of {', '.join(LR_SCHEDULES)}, got {ls.name!r}")
    if ls.decay_shape not in DECAY_SHAPES:
        raise ConfigError(f"lr_scheduler.decay_shape: expected one of {', '.join(DECAY_SHAPES)}, "
                          f"got {ls.decay_shape!r}")
    if not 0.0 <= ls.decay_ratio <= 1.0:
        raise ConfigError(f"lr_scheduler.decay_ratio: expected a fraction in [0, 1], got {ls.decay_ratio}")
    if ls.decay_start_step is not None and (isinstance(ls.decay_start_step, bool) or ls.decay_start_step < 0):
        raise ConfigError(f"lr_scheduler.decay_start_step: expected a step >= 0 or None, got {ls.decay_start_step!r}")
    if ls.name == "cosine":
        wsd_only = _set_keys(ls, "decay_")
        if wsd_only:
            raise ConfigError(f"lr_scheduler.{wsd_only[0]}: a key of the wsd schedule, but lr_scheduler.name is "
                              "'cosine' (set lr_scheduler.name='wsd')")


def check_optimizer(opt: Any) -> None:
    """name adamw or muon; the Muon keys valid, and left at their defaults under adamw."""
    if opt.name not in OPTIMIZERS:
        raise ConfigError(f"optimizer.name: expected one of {', '.join(OPTIMIZERS)}, got {opt.name!r}")
    if opt.name == "adamw":
        muon_only = _set_keys(opt, "muon_")
        if muon_only:
            raise ConfigError(f"optimizer.{muon_only[0]}: a key of Muon, but optimizer.name is 'adamw' "
                              "(set optimizer.name='muon')")
        return
    if not 0.0 <= opt.muon_momentum < 1.0:
        raise ConfigError(f"optimizer.muon_momentum: expected a value in [0, 1), got {opt.muon_momentum}")
    if isinstance(opt.muon_ns_steps, bool) or not 1 <= opt.muon_ns_steps < 100:
        raise ConfigError(f"optimizer.muon_ns_steps: expected an integer in [1, 100), got {opt.muon_ns_steps!r}")
    if len(tuple(opt.muon_ns_coefficients)) != 3:
        raise ConfigError(f"optimizer.muon_ns_coefficients: expected three numbers (a, b, c), "
                          f"got {opt.muon_ns_coefficients!r}")
    if opt.muon_ns_dtype not in NS_DTYPES:
        raise ConfigError(f"optimizer.muon_ns_dtype: expected one of {', '.join(NS_DTYPES)}, got {opt.muon_ns_dtype!r}")
    tau = opt.muon_qk_clip
    if tau is not None and (isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0):
        raise ConfigError(f"optimizer.muon_qk_clip: expected a logit threshold > 0 or None, got {tau!r}")
    if not opt.muon_rms_scale > 0:
        raise ConfigError(f"optimizer.muon_rms_scale: expected a value > 0, got {opt.muon_rms_scale}")
