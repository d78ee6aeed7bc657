"""The policy of `model.checkpoint` (activation checkpointing) as plain values; parallel/activation_checkpoint.py
applies it, the estimator and the config checks read it."""

from __future__ import annotations

from typing import Union

from ..errors import ConfigError

POLICIES = ("full", "selective")


def checkpoint_plan(setting: Union[bool, float, str], key: str = "model.checkpoint") -> tuple[str, float]:
    """(policy, fraction of blocks) of a `model.checkpoint` value: True / "full" -> ("full", 1.0), "selective" ->
    ("selective", 1.0), a fraction f in [0, 1] -> ("full", f), False -> ("full", 0.0); ConfigError otherwise."""
    if isinstance(setting, bool):
        return "full", 1.0 if setting else 0.0
    if isinstance(setting, str):
        if setting in POLICIES:
            return setting, 1.0
        raise ConfigError(f"{key}: expected True, False, \"full\", \"selective\" or a fraction in [0, 1], "
                          f"got {setting!r}")
    if isinstance(setting, (int, float)) and 0.0 <= float(setting) <= 1.0:
        return "full", float(setting)
    raise ConfigError(f"{key}: expected True, False, \"full\", \"selective\" or a fraction in [0, 1], got {setting!r}")
