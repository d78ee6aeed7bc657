"""`model.fp8` with an MXFP8 recipe: torchao's MXFP8TrainingOpConfig on the dense linears and the MoE experts.

torchao 0.18 trains MXFP8 by wrapping a weight's data in MXFP8TrainingWeightWrapperTensor (`quantize_` with the
config): its F.linear / matmul and `torch._grouped_mm` (2-D rows x 3-D weights with offsets: the routed experts)
quantize both operands to MXFP8 (float8_e4m3fn values, one power-of-two scale per 32) and run the scaled GEMM;
every other op sees the high-precision weight. The parameter keeps its name, shape and dtype, so the
initialization, the optimizer and the checkpoints are the high-precision model's (no state beyond the parameters).

Kernels: CUDA with SM >= 10.0 runs torchao's MXFP8 kernels (KernelPreference.AUTO). A CPU emulates (EMULATED:
the operands are quantized and dequantized with torch ops, then multiplied in high precision: the numbers of
MXFP8 rounding, the speed of neither), and so does the recipe "mxfp8_emulated_rceil" on any device; CUDA below
SM 10.0 is refused. The experts are converted only when they multiply with the grouped GEMM: torchao's wrapper
overrides `_grouped_mm` only, and a loop of per-expert GEMMs would see plain high-precision slices.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch
import torch.nn as nn

from ..config.fp8 import MX_BLOCK, Fp8Plan
from ..errors import ConfigError

__all__ = ["mx_kernel", "expert_modules", "expert_skip_reason", "swap_mx_weights"]


def mx_kernel(plan: Fp8Plan, device: torch.device) -> str:
    """'emulated' or 'auto' (torchao's kernels) for this recipe on this device; ConfigError where neither runs."""
    if plan.recipe == "mxfp8_emulated_rceil" or device.type in ("cpu", "meta"):
        return "emulated"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (10, 0):
        return "auto"
    where = f"sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}" if device.type == "cuda" \
        else device.type
    raise ConfigError(f"model.fp8: {plan.recipe} needs MXFP8 GEMMs (CUDA SM >= 10.0), not on {where}; "
                      "'mxfp8_emulated_rceil' emulates them (slow, for checks)")


def expert_modules(blocks: Iterable[nn.Module]) -> dict[int, nn.Module]:
    """{id: module} of the modules inside `blocks` whose own parameters are all 3-D (a MoE layer's stacked experts
    [E, rows, columns])."""
    found = {}
    for block in blocks:
        for m in block.modules():
            own = list(m.parameters(recurse=False))
            if own and all(p.dim() == 3 for p in own):
                found[id(m)] = m
    return found


def expert_skip_reason(name: str, module: nn.Module, plan: Fp8Plan, grouped: bool) -> str | None:
    """Why the experts `module` stay in high precision under an MXFP8 recipe (None: converted)."""
    if any(s in name for s in plan.filter_fqns):
        return "model.fp8.filter_fqns"
    if not grouped:
        return "experts multiply one GEMM each (moe.expert_gemm not grouped); torchao wraps the grouped GEMM only"
    dims = sorted({d for p in module.parameters(recurse=False) for d in p.shape[1:]})
    if any(d % MX_BLOCK for d in dims):
        return f"expert dims {tuple(dims)} not multiples of {MX_BLOCK}"
    return None


def swap_mx_weights(model: nn.Module, chosen: set[int], plan: Fp8Plan, kernel: str) -> None:
    """Wrap, for MXFP8 training, the `weight` of each linear and every 3-D parameter of each experts module whose
    id is in `chosen` (as torchao's quantize_ handler does, but never a bias: torchao's F.linear override drops
    it, so a linear's bias stays a plain parameter that model/layers.linear adds)."""
    config = _mx_config(plan, kernel)
    from torchao.prototype.moe_training.tensor import MXFP8TrainingWeightWrapperTensor as Wrapper
    for module in model.modules():
        if id(module) not in chosen:
            continue
        names = ["weight"] if isinstance(module, nn.Linear) else \
            [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
        for name in names:
            p = getattr(module, name)
            setattr(module, name, nn.Parameter(Wrapper(p.data, config), requires_grad=p.requires_grad))


def _mx_config(plan: Fp8Plan, kernel: str) -> Any:
    """torchao's MXFP8TrainingOpConfig of the recipe (its grouped GEMM returns bf16, as torchao's default; the
    experts cast it to their compute dtype) with the kernel preference."""
    try:
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
        from torchao.quantization.quantize_.common import KernelPreference
    except ImportError as e:
        raise ConfigError(f"model.fp8: {plan.recipe} needs torchao >= 0.18 (its MXFP8 training), which does not "
                          f"import here: {e}") from e
    recipe = "mxfp8_rceil_wgrad_with_hp" if plan.recipe == "mxfp8_rceil_wgrad_with_hp" else "mxfp8_rceil"
    config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(recipe))
    preference = KernelPreference.EMULATED if kernel == "emulated" else KernelPreference.AUTO
    # pad each expert's rows to a multiple of the block: the weight gradient is scaled along the rows
    return dataclasses.replace(config, kernel_preference=preference, pad_token_groups_for_grouped_mm=True)
