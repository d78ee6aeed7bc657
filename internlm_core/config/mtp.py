"""`model.mtp` (multi-token prediction, model/mtp.py): the spellings users bring, and the layouts it runs under.

DeepSeek's `num_nextn_predict_layers` (its config.json's key) and Megatron's `mtp_num_layers` /
`mtp_loss_scaling_factor` map onto model.mtp = dict(depth, loss_weight); a value given twice differently is
refused in one line.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..model.mtp import MTPSettings, mtp_settings

# the other spellings -> model.mtp's key they set
_SPELLINGS = {"num_nextn_predict_layers": "depth", "mtp_num_layers": "depth", "mtp_loss_scaling_factor": "loss_weight"}


def mtp_forms(model: dict, mapped: list[str]) -> None:
    """Move DeepSeek's / Megatron's MTP keys of a raw `model` section into `model["mtp"]` (in place), noting each
    translation in `mapped`; ConfigError when two spellings disagree."""
    given = {k: model.pop(k) for k in list(_SPELLINGS) if k in model}
    if not given:
        return
    mtp = model.get("mtp")
    out = dict(mtp) if isinstance(mtp, dict) else ({"depth": mtp} if isinstance(mtp, int) and mtp else {})
    for key, value in given.items():
        target = _SPELLINGS[key]
        if target in out and out[target] != value:
            raise ConfigError(f"model.{key}={value!r}: model.mtp already sets {target}={out[target]!r}")
        out[target] = value
        mapped.append(f"model.{key}={value!r} -> model.mtp.{target}")
    if out.get("depth", 1) in (0, None):  # num_nextn_predict_layers=0: no MTP (the weight alone means nothing)
        out = None
    model["mtp"] = out


def check_mtp(model: Any, tensor: int) -> MTPSettings:
    """model.mtp's value, and the layouts it is refused under (tensor parallel: its depths have no plan yet)."""
    settings = mtp_settings(model.mtp)
    if settings.on and tensor > 1:
        raise ConfigError(f"model.mtp: not with parallel.tensor={tensor} (the MTP depths have no tensor-parallel "
                          f"plan yet); use data, context or pipeline parallel")
    return settings
