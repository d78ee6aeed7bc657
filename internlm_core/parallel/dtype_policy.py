"""The parallel side of the dtype policy (numerics/precision.py): who casts, and the parameters FSDP keeps in fp32.

    if fsdp_wraps(dims):                      # FSDP's MixedPrecisionPolicy casts: autocast stays off
        apply_fp32_units(blocks, dims, ...)   # before the blocks' own fully_shard
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ..distributed.parallel_dims import ParallelDims
from .fsdp import _data_mesh


def fsdp_wraps(dims: ParallelDims) -> bool:
    """FSDP wraps the model (parallelize_model) exactly when data x context parallel > 1: its mixed precision policy
    is then the run's only cast (Precision.under_fsdp)."""
    return dims.dp_cp > 1


def fp32_modules(blocks: list[nn.Module]) -> list[nn.Module]:
    """The modules inside `blocks` whose parameters must stay in their own dtype under FSDP's 16-bit policy: those
    whose class sets `fsdp_param_dtype` (the MoE router's gate: InternEvo's "always fp32" gate)."""
    return [m for block in blocks for m in block.modules() if getattr(m, "fsdp_param_dtype", None) is not None]


def apply_fp32_units(blocks: list[nn.Module], dims: ParallelDims, reshard_after_forward: bool,
                     reduce_dtype: Optional[torch.dtype]) -> int:
    """Give each of `fp32_modules(blocks)` an FSDP unit of its own on the blocks' data-parallel mesh, its
    parameters gathered in the module's `fsdp_param_dtype` (fp32), gradients reduced in `reduce_dtype`, so the
    block's 16-bit unit (applied afterwards) leaves them out. Gradients are averaged over the same ranks as the
    block's. Returns how many units it made."""
    modules = fp32_modules(blocks)
    mesh = _data_mesh(dims, "dp_shard_cp")
    for module in modules:
        policy = MixedPrecisionPolicy(param_dtype=module.fsdp_param_dtype, reduce_dtype=reduce_dtype)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    return len(modules)
