"""`model.fp8`: float8 training of the linear layers through torchao, read into plain values (no torchao here).

Spellings accepted (InternEvo has no float8 key; torchtitan's `[float8]` section is taken as a dict):
  None, False, "off"                 off (the default)
  True                               "tensorwise" (torchtitan's default when float8 is on without a recipe_name)
  "tensorwise" | "rowwise" | "rowwise_with_gw_hp"
                                     torchao's recipe names (Float8LinearConfig.from_recipe_name)
  "mxfp8" | "mxfp8_rceil" | "mxfp8_rceil_wgrad_with_hp" | "mxfp8_emulated_rceil"
                                     MXFP8 (blocks of 32 values share a power-of-two scale): torchao 0.18's
                                     MXFP8TrainingRecipe names ("mxfp8" is torchtitan's short name for
                                     "mxfp8_rceil"); dense linears and the MoE experts' grouped GEMM. On a CPU the
                                     GEMMs are emulated (dequantized, then a high-precision GEMM: the same rounding
                                     of the operands, for tests); on CUDA they need SM >= 10.0 (Blackwell), else
                                     refused ("mxfp8_emulated_rceil" emulates on any device). torchao's other MX
                                     formats (mxfp4, nvfp4) have no training recipe here: refused.
  dict(recipe_name=..., enable_fsdp_float8_all_gather=False, filter_fqns=[...], min_features=...)
                                     torchtitan's keys; `recipe` is taken for `recipe_name`; filter_fqns: extra
                                     module names (substrings) left in high precision; min_features: see below.

Which linears stay in high precision (parallel/float8.py applies it; the rule, written down):
  - the embedding (not a linear) and the output head (`output`, the module the family ties to the vocabulary);
  - MoE routers / gates and the residual-MoE coefficient (their names end in `gate`, `router` or `coefficient`:
    routing decisions are kept exact; the grouped experts are 3-D parameters, never nn.Linear);
  - linears whose in_features or out_features is not a multiple of 16 (torch._scaled_mm's alignment; 32, the block,
    for mxfp8) or is smaller than `min_features` (default 64: below it the casts cost more than the GEMM saves);
  - any module whose name contains one of `filter_fqns`;
  - MoE experts (3-D weights [E, rows, columns]): high precision under the float8 recipes (torchao's Float8Linear
    swaps linears only); under mxfp8 they take torchao's MXFP8 grouped GEMM when the experts multiply with the
    grouped GEMM (`moe.expert_gemm` resolved to "grouped") and their dims are multiples of 32, else they stay in
    high precision with the reason logged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..errors import ConfigError

FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
MX_RECIPES = ("mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp", "mxfp8_emulated_rceil")
MX_ALIASES = {"mxfp8": "mxfp8_rceil"}  # torchtitan's short name
RECIPES = FLOAT8_RECIPES + tuple(MX_ALIASES) + MX_RECIPES
MX_BLOCK = 32  # values per shared scale in MXFP8 (and the alignment of every dim it scales along)
MIN_FEATURES = 64
_KEYS = ("recipe_name", "recipe", "enable_fsdp_float8_all_gather", "filter_fqns", "min_features")


@dataclass(frozen=True)
class Fp8Plan:
    """What `model.fp8` asks for, as plain values."""

    recipe: str                              # torchao's recipe name
    fsdp_float8_all_gather: bool = False     # FSDP2 all-gathers the float8 weights (tensorwise only)
    filter_fqns: tuple[str, ...] = ()        # extra module-name substrings kept in high precision
    min_features: int = MIN_FEATURES         # linears with a dimension below this stay in high precision

    @property
    def mx(self) -> bool:
        """An MXFP8 recipe (torchao's MXFP8TrainingOpConfig), not a float8 one (Float8Linear)."""
        return self.recipe in MX_RECIPES

    @property
    def alignment(self) -> int:
        """What every dim of a converted linear must be a multiple of."""
        return MX_BLOCK if self.mx else 16


def _recipe(name: Any) -> str:
    if isinstance(name, str) and name not in RECIPES and name.lower().startswith(("mx", "nvfp")):
        raise ConfigError(f"model.fp8: {name!r} has no training recipe in torchao 0.18 (its MX training recipes: "
                          f"{', '.join(('mxfp8', *MX_RECIPES))})")
    if name not in RECIPES:
        raise ConfigError(f"model.fp8: expected off, {', '.join(RECIPES)} or a dict with recipe_name, got {name!r}")
    return MX_ALIASES.get(name, name)


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


ROUTING_NAMES = ("gate", "router", "coefficient")  # module names (last component) of MoE routing: high precision


def linear_skip_reason(name: str, in_features: int, out_features: int, plan: Fp8Plan) -> Optional[str]:
    """Why a linear of the transformer blocks named `name` stays in high precision (None: converted), by the
    module docstring's rule; parallel/float8.py applies it to modules, estimate/lowp.py to a family's counts."""
    if name.rsplit(".", 1)[-1] in ROUTING_NAMES:
        return "MoE routing"
    if any(s in name for s in plan.filter_fqns):
        return "model.fp8.filter_fqns"
    dims = (in_features, out_features)
    if any(d % plan.alignment for d in dims):
        return f"features {dims} not multiples of {plan.alignment}"
    if min(dims) < plan.min_features:
        return f"features {dims} below min_features {plan.min_features}"
    return None

