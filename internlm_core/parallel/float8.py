"""`model.fp8`: swap a model's linear layers for torchao's Float8Linear, before tensor parallel, checkpointing,
compile and FSDP wrap it (as torchtitan converts before parallelizing).

torchao is imported only here and only when `model.fp8` is on; a config asking for it where it is not installed is
refused in one line. The project's `Linear` (model/layers.py) is an nn.Linear subclass, so torchao's
`convert_to_float8_training` recognizes it; the swapped Float8Linear keeps the names `weight` / `bias`, so the
initialization (model/init.py, by name) and the checkpoints are those of the bf16 model. Which layers stay in
high precision is config/fp8.py's rule (`skip_reason`). With dynamic scaling (every recipe torchao names) the scales
are recomputed from each step's tensors: a float8 model has no state beyond its parameters, and its checkpoint is
the bf16 model's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn as nn

from ..config.fp8 import ROUTING_NAMES, Fp8Plan, linear_skip_reason
from ..errors import ConfigError
from ..utils.logging import get_logger
from .mxfp8 import expert_modules, expert_skip_reason, mx_kernel, swap_mx_weights

__all__ = ["convert_to_fp8", "skip_reason", "check_fp8_layout"]

logger = get_logger(__name__)


def skip_reason(name: str, module: nn.Linear, in_blocks: bool, plan: Fp8Plan) -> Optional[str]:
    """Why linear `name` stays in high precision (None: it is converted), by config/fp8.py's written rule."""
    if not in_blocks:
        return "outside the transformer blocks (output head)"
    return linear_skip_reason(name, module.in_features, module.out_features, plan)


def _torchao_float8() -> Any:
    try:
        import torchao.float8 as ao_float8
    except ImportError as e:
        raise ConfigError(f"model.fp8: needs torchao (pip install torchao), which does not import here: {e}") from e
    return ao_float8


def check_fp8_layout(plan: Fp8Plan, tensor: int) -> None:
    """Refuse, in one line, the layouts low-precision training does not compose with here (gloo's float8
    all-gather is no longer one of them: send_float8_as_bytes)."""
    if plan.mx and tensor > 1:
        raise ConfigError(f"model.fp8: {plan.recipe} not with parallel.tensor > 1 (torchao's MXFP8 weight wrapper "
                          "has no tensor-parallel styles)")


def convert_to_fp8(model: nn.Module, blocks: Iterable[nn.Module], plan: Fp8Plan, *,
                   device: Optional[torch.device] = None, grouped_experts: bool = False) -> dict[str, str]:
    """Convert the linears of `model` that the rule keeps in low precision (in place, on any device, the meta device
    included; `blocks`: the family plan's transformer blocks): torchao's Float8Linear for the float8 recipes, its
    MXFP8 weight wrapper for the mxfp8 ones (also the MoE experts when `grouped_experts`: they multiply with the
    grouped GEMM). `device`: where the run computes (mxfp8's kernel choice; default CPU). Logs the recipe, the count and the skipped layers once; returns {skipped name: reason}."""
    blocks = list(blocks)
    in_blocks = {id(m) for b in blocks for m in b.modules()}
    skipped: dict[str, str] = {}
    converted: list[str] = []

    def keep_low(module: nn.Module, fqn: str) -> bool:
        reason = skip_reason(fqn, module, id(module) in in_blocks, plan)
        (skipped.__setitem__(fqn, reason) if reason else converted.append(fqn))
        return reason is None

    if plan.mx:
        note = _convert_mx(model, blocks, plan, device or torch.device("cpu"), grouped_experts, keep_low, skipped,
                           converted)
    else:
        note = _convert_float8(model, plan, keep_low)
        skipped.update(_moe_untouched(model, blocks))
    logger.info(f"model.fp8: recipe {plan.recipe}, {len(converted)} {'layers' if plan.mx else 'linear layers'} in "
                f"{'mxfp8' if plan.mx else 'float8'}{note}"
                + (f"; kept in high precision: {'; '.join(f'{k} ({v})' for k, v in skipped.items())}"
                   if skipped else ""))
    return skipped


def _convert_float8(model: nn.Module, plan: Fp8Plan, keep_low: Callable[[nn.Module, str], bool]) -> str:
    """torchao's Float8Linear for every linear `keep_low` accepts; returns the log line's note."""
    ao_float8 = _torchao_float8()
    config = ao_float8.Float8LinearConfig.from_recipe_name(plan.recipe)
    if plan.fsdp_float8_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    ao_float8.convert_to_float8_training(model, config=config, module_filter_fn=keep_low)
    return ", float8 FSDP all-gather" if plan.fsdp_float8_all_gather else ""


def _moe_untouched(model: nn.Module, blocks: list[nn.Module]) -> dict[str, str]:
    """The MoE modules the float8 recipes leave in high precision with no linear to skip, for the log line: the
    stacked experts (3-D weights) and the routers (a module holding its [E, h] weight)."""
    experts = expert_modules(blocks)
    in_blocks = {id(m) for b in blocks for m in b.modules()}
    out = {}
    for fqn, module in model.named_modules():
        if id(module) in experts:
            out[fqn] = "MoE experts: 3-D weights, torchao's float8 recipes convert linears only (mxfp8 takes them)"
        elif (id(module) in in_blocks and not isinstance(module, nn.Linear)
              and fqn.rsplit(".", 1)[-1] in ROUTING_NAMES and any(True for _ in module.parameters(recurse=False))):
            out[fqn] = "MoE routing"
    return out


def _convert_mx(model: nn.Module, blocks: list[nn.Module], plan: Fp8Plan, device: torch.device,
                grouped_experts: bool, keep_low: Callable[[nn.Module, str], bool], skipped: dict[str, str],
                converted: list[str]) -> str:
    """torchao's MXFP8 weight wrapper on the linears `keep_low` accepts and on the experts; returns the note."""
    _torchao_float8()  # the one "needs torchao" refusal
    kernel = mx_kernel(plan, device)
    experts = expert_modules(blocks)
    chosen: set[int] = set()
    for fqn, module in model.named_modules():
        if id(module) in experts:
            reason = expert_skip_reason(fqn, module, plan, grouped_experts)
            (skipped.__setitem__(fqn, reason) if reason else converted.append(fqn))
            ok = reason is None
        else:
            ok = isinstance(module, nn.Linear) and keep_low(module, fqn)
        if ok:
            chosen.add(id(module))
    swap_mx_weights(model, chosen, plan, kernel)
    return ", GEMMs emulated (dequantized, then high precision)" if kernel == "emulated" else ", torchao's MXFP8 GEMMs"


def float8_tp_styles(plan: Fp8Plan, backend: Optional[str] = None,
                     sequence_parallel: bool = False) -> Optional[Callable[[nn.Module, dict], dict]]:
    """The family plan's hook for tensor parallel (TensorParallelOptions.linear_styles) under `plan`: the tensorwise
    recipe gets torchao's Float8ColwiseParallel / Float8RowwiseParallel for its Float8Linear modules (each input
    cast to float8 once with the scale of the whole tensor, then redistributed in float8; the output gradient cast
    in backward), as torchtitan does; rowwise recipes keep the plain styles (their scales are per row: DTensor's
    reductions give the amaxes), and so does a linear left in high precision. None: no change. On gloo with
    sequence parallel the float8 styles would all-gather float8 DTensors, which gloo cannot ("Invalid scalar
    type"): the plain styles there (the same scales: DTensor reduces the amaxes; the gathers in high precision),
    said once in the log."""
    if plan.mx or plan.recipe != "tensorwise":
        return None
    if backend == "gloo" and sequence_parallel:
        logger.info("model.fp8: tensor parallel with DTensor's plain styles (gloo cannot all-gather the float8 "
                    "sequence-parallel activations of torchao's float8 styles)")
        return None

    def styles(block: nn.Module, block_plan: dict) -> dict:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

        out = dict(block_plan)
        for key, style in block_plan.items():
            kind = {ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}.get(type(style))
            if kind is not None and isinstance(block.get_submodule(key), Float8Linear):
                out[key] = kind(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                                use_local_output=style.use_local_output)
        return out

    return styles


def send_float8_as_bytes(model: nn.Module) -> int:
    """model.fp8's float8 all-gather on a backend without float8 dtypes (gloo: "Invalid scalar type"): every FSDP
    unit of `model` all-gathers through a custom AllGather that sends a float8 buffer as its bytes (a uint8 view of
    the same memory: bitwise the float8 values). FSDP itself switches to uint8 when a unit gathers mixed dtypes (a
    block's norms beside its float8 weights); a unit of float8 weights only would hand gloo a float8 buffer. Returns
    the number of units; ConfigError where this torch's FSDP2 takes no custom all-gather."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    from ..utils.collectives import all_gather_single
    from .comm import float8_as_bytes

    class Float8AsBytes(AllGather):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                     async_op: bool = False) -> Any:
            return all_gather_single(*float8_as_bytes(output_tensor, input_tensor), group=group, async_op=async_op)

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        if not hasattr(unit, "set_custom_all_gather"):
            raise ConfigError(f"model.fp8.enable_fsdp_float8_all_gather: torch {torch.__version__}'s FSDP2 takes no "
                              "custom all-gather, which gloo needs for float8 tensors; use nccl or leave it False")
        unit.set_custom_all_gather(Float8AsBytes())
    return len(units)

