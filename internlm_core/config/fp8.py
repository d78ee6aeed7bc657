"""`model.fp8`: float8 training of the linear layers through torchao, read into plain values (no torchao here).

Spellings accepted (InternEvo has no float8 key; torchtitan's `[float8]` section is taken as a dict):
  None, False, "off"                 off (the default)
  True                               "tensorwise" (torchtitan's default when float8 is on without a recipe_name)
  "tensorwise" | "rowwise" | "rowwise_with_gw_hp"
                                     torchao's recipe names (Float8LinearConfig.from_recipe_name)
  dict(recipe_name=..., enable_fsdp_float8_all_gather=False, filter_fqns=[...], min_features=...)
                                     torchtitan's keys; `recipe` is taken for `recipe_name`; filter_fqns: extra
                                     module names (substrings) left in high precision; min_features: see below.

Which linears stay in high precision (parallel/float8.py applies it; the rule, written down):
  - the embedding (not a linear) and the output head (`output`, the module the family ties to the vocabulary);
  - MoE routers / gates and the residual-MoE coefficient (their names end in `gate`, `router` or `coefficient`:
    routing decisions are kept exact; the grouped experts are 3-D parameters, never nn.Linear);
  - linears whose in_features or out_features is not a multiple of 16 (torch._scaled_mm's alignment) or is smaller
    than `min_features` (default 64: below it the casts cost more than the GEMM saves);
  - any module whose name contains one of `filter_fqns`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..errors import ConfigError

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
MIN_FEATURES = 64
_KEYS = ("recipe_name", "recipe", "enable_fsdp_float8_all_gather", "filter_fqns", "min_features")


@dataclass(frozen=True)
class Fp8Plan:
    """What `model.fp8` asks for, as plain values."""

    recipe: str                              # torchao's recipe name
    fsdp_float8_all_gather: bool = False     # FSDP2 all-gathers the float8 weights (tensorwise only)
    filter_fqns: tuple[str, ...] = ()        # extra module-name substrings kept in high precision
    min_features: int = MIN_FEATURES         # linears with a dimension below this stay in high precision


def _recipe(name: Any) -> str:
    if name not in RECIPES:
        raise ConfigError(f"model.fp8: expected off, {', '.join(RECIPES)} or a dict with recipe_name, got {name!r}")
    return name


def fp8_plan(value: Any) -> Optional[Fp8Plan]:
    """The Fp8Plan of a `model.fp8` value (None: off); ConfigError naming the key for anything else."""
    if value is None or value is False or value == "off":
        return None
    if value is True:
        return Fp8Plan("tensorwise")
    if isinstance(value, str):
        return Fp8Plan(_recipe(value))
    if not isinstance(value, dict):
        raise ConfigError(f"model.fp8: expected off, {', '.join(RECIPES)} or a dict, got {value!r}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ConfigError(f"model.fp8.{unknown[0]}: unknown key (expected any of {', '.join(_KEYS)})")
    recipe = _recipe(value.get("recipe_name", value.get("recipe", "tensorwise")))
    gather = value.get("enable_fsdp_float8_all_gather", False)
    if not isinstance(gather, bool):
        raise ConfigError(f"model.fp8.enable_fsdp_float8_all_gather: expected True or False, got {gather!r}")
    if gather and recipe != "tensorwise":
        raise ConfigError(f"model.fp8.enable_fsdp_float8_all_gather: torchao gathers float8 weights for the "
                          f"tensorwise recipe only, not {recipe}")
    fqns = value.get("filter_fqns", ())
    if isinstance(fqns, str) or not all(isinstance(x, str) for x in fqns):
        raise ConfigError(f"model.fp8.filter_fqns: expected a list of module-name substrings, got {fqns!r}")
    least = value.get("min_features", MIN_FEATURES)
    if not isinstance(least, int) or isinstance(least, bool) or least < 16:
        raise ConfigError(f"model.fp8.min_features: expected an integer >= 16, got {least!r}")
    return Fp8Plan(recipe, gather, tuple(fqns), least)
