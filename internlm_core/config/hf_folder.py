"""A Hugging Face folder the run loads (`ckpt.load_ckpt_info`, ckpt_type "hf") defines the model: its config.json's
keys (what the family's adapter reads: shape, numerics, windows, routing) go into the run's config where the config
left them at their defaults (one log line), and a key the config sets to another value is refused, naming both,
unless `ckpt.load_ckpt_info.keep_run_keys` names it. Runs in build_config, before the checks, so that the model
built, the estimates and the exports are the folder's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..errors import ConfigError
from ..model.foreign_keys import config_key, differences, folder_name, run_value, set_by, set_run_value
from ..model.spec import get_model_spec

HF_TYPES = ("hf", "hf_llama")


def explicit_keys(raw: Mapping[str, Any], prefix: str = "") -> set[str]:
    """The dotted keys a (normalized) raw config sets to a value other than None."""
    out: set[str] = set()
    for k, v in raw.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out |= explicit_keys(v, key + ".")
        elif v is not None:
            out.add(key)
    return out


def _folder_config(cfg: Any) -> tuple[Path, dict] | None:
    """(config.json, its content) of the local Hugging Face folder the run starts from, or None (no such load:
    another format, object storage or no folder there: the load itself says what is wrong). Under auto_resume too:
    the folder is the first start's weights, and the checkpoints a restart resumes hold that same model."""
    info = cfg.ckpt.load_ckpt_info
    if info is None or not info.path or str(info.ckpt_type).lower() not in HF_TYPES:
        return None
    path = Path(str(info.path).removeprefix("local:")) / "config.json"
    if not path.is_file():
        return None
    try:
        c = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"ckpt.load_ckpt_info.path: {path}: not readable JSON ({e})") from None
    return (path, c) if isinstance(c, dict) else None


def _adapter(model_type: str, c: Mapping[str, Any]) -> Any:
    """The family's adapter of the folder's class (None when the family reads no such class: refused)."""
    archs = c.get("architectures") or []
    for ad in get_model_spec(model_type).adapters.values():
        if ad.format == "hf" and ((archs and archs[0] in ad.architectures) or
                                  (not archs and c.get("model_type") in ad.hf_model_types)):
            return ad
    return None


def adopt_hf_folder(cfg: Any, explicit: Iterable[str]) -> None:
    """Take the loaded Hugging Face folder's model keys into `cfg` (see the module); `explicit`: the dotted keys
    the config file and --set gave (explicit_keys of the raw config)."""
    found = _folder_config(cfg)
    if found is None:
        return
    path, c = found
    adapter = _adapter(cfg.model_type, c)
    if adapter is None:  # refused here: the family's defaults would be built (and estimated) before the load says so
        reads = [a for ad in get_model_spec(cfg.model_type).adapters.values() if ad.format == "hf"
                 for a in ad.architectures]
        raise ConfigError(f"ckpt.load_ckpt_info.path: {path} holds a "
                          f"{(c.get('architectures') or [c.get('model_type')])[0]}; model_type {cfg.model_type} "
                          f"reads {', '.join(dict.fromkeys(reads)) or 'no Hugging Face class'} (set the model_type "
                          f"of the folder's class)")
    keys = adapter.config_from_foreign(c, str(path))
    keep = tuple(cfg.ckpt.load_ckpt_info.keep_run_keys)
    unknown = [k for k in keep if k not in {config_key(key) for key in keys}]
    if unknown:
        raise ConfigError(f"ckpt.load_ckpt_info.keep_run_keys: {', '.join(unknown)} not among the keys {path} "
                          f"fixes ({', '.join(config_key(k) for k in keys)})")
    m, moe, given = cfg.model, cfg.moe, set(explicit)
    diff = differences(keys, lambda k: run_value(k, m, moe), c, (c.get("architectures") or [""])[0], keep)
    refused = [d for k, d in diff if any(s in given for s in set_by(k))]
    if refused:
        raise ConfigError(f"{path} defines the model it holds, the config sets otherwise: {'; '.join(refused)} "
                          f"(drop these keys from the config to take the folder's values, or name them in "
                          f"ckpt.load_ckpt_info.keep_run_keys to train with the config's)")
    for key, _ in diff:
        if cfg.compat_notes is not None:
            cfg.compat_notes.adopted.append(f"{config_key(key)}={keys[key]!r} ({folder_name(key, c)}; the default "
                                            f"was {run_value(key, m, moe)!r})")
        set_run_value(key, m, moe, keys[key])
