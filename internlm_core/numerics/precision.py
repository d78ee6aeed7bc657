"""Precision: the dtypes of one run, resolved once from `model.dtype` and the device.

    precision = resolve_precision(cfg.model.dtype, device).under_fsdp(fsdp_wraps)
    precision.apply_backend_settings()        # TF32 on CUDA for torch.tf32, nothing otherwise
    with precision.autocast():                # bf16/fp16 autocast without FSDP; nothing for fp32/tf32 or under FSDP
        ...

This is the only table from dtype names to torch dtypes; the config only normalizes spellings
(`bf16` -> `torch.bfloat16`) and checks the name is one of `DTYPE_NAMES`.

The dtype policy of 16-bit runs (bf16 / fp16), one rule per place, on every device:

- One caster. Where FSDP wraps the model (data x context parallel > 1), its MixedPrecisionPolicy gathers the
  parameters in the compute dtype and that is the only cast: no autocast on top (torchtitan's rule). Activations
  are then 16-bit from the embedding on, residual stream included; gradients are reduced in fp32 and the sharded
  master weights and AdamW's state stay fp32. Without FSDP (one device, or tensor / pipeline parallel only) the
  parameters stay fp32 and autocast casts each matmul's operands; the residual stream stays fp32.
  Why not both: CUDA's autocast runs norms (and other ops of its fp32 list) in fp32 and hands fp32 on, so on top
  of 16-bit parameters every norm output became fp32 (~30% more activations, fp32 sequence-parallel all-gathers
  and expert all-to-all rows, fp32 q/k next to a bf16 v in attention), and the CPU's autocast, which does not,
  could not show it.
- Norms compute their statistics in fp32 and return their input's dtype (model/layers.RMSNorm switches autocast
  off inside; model.use_fp32_norm computes the whole norm in fp32 and casts back).
- Attention takes q, k, v in one dtype (model/context/blockwise.one_dtype); its softmax statistics are fp32.
- Parameters that must stay fp32 say so (`fsdp_param_dtype = torch.float32`: the MoE router's gate): FSDP gives
  them a unit of their own whose policy gathers them in fp32 (parallel/dtype_policy.py); they compute with autocast
  off, on an fp32 copy of their input.
- The loss upcasts the logits to fp32 itself (loss.py), with or without autocast.
fp32 / tf32 runs: no cast anywhere (FSDP's default policy, no autocast).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from ..errors import ConfigError

# canonical model.dtype -> (compute dtype, TF32 matmuls on CUDA, the class of the device's peak FLOP/s)
_TABLE = {
    "torch.float32": (torch.float32, False, "fp32"),
    "torch.tf32": (torch.float32, True, "tf32"),
    "torch.bfloat16": (torch.bfloat16, False, "bf16"),
    "torch.float16": (torch.float16, False, "fp16"),
}
DTYPE_NAMES = tuple(_TABLE)
HALF_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Precision:
    """The numerics of one run on one device type.

    param_dtype: parameters, their gradients and AdamW's state (fp32 master weights in every mode).
    compute_dtype: matmuls and activations (FSDP's gathered parameters, else autocast, when it differs from
        param_dtype; see the module's dtype policy).
    reduce_dtype: gradients reduced across data-parallel ranks.
    loss_scaling: fp16 only: the loss is multiplied by a dynamic scale (`optim.DynamicGradScaler`).
    tf32: fp32 matmuls on TF32 tensor cores (torch.tf32 on CUDA; other devices have no TF32).
    export_dtype: the weights' dtype in exported checkpoints (Hugging Face `torch_dtype`).
    peak: which peak FLOP/s the MFU is measured against ("fp32", "tf32", "bf16", "fp16").
    """

    name: str
    device_type: str
    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    loss_scaling: bool
    tf32: bool
    export_dtype: torch.dtype
    peak: str
    fsdp_casts: bool = False  # FSDP's policy gathers the parameters in compute_dtype: autocast stays off

    @property
    def uses_autocast(self) -> bool:
        """16-bit compute over fp32 parameters that FSDP does not cast: autocast casts the operands."""
        return self.compute_dtype != self.param_dtype and not self.fsdp_casts

    def under_fsdp(self, wrapped: bool) -> Precision:
        """This precision for a model FSDP wraps (`wrapped`) or not: under FSDP a 16-bit compute dtype is FSDP's
        param_dtype and autocast stays off (the module's dtype policy)."""
        return dataclasses.replace(self, fsdp_casts=wrapped and self.compute_dtype != self.param_dtype)

    @property
    def half(self) -> bool:
        """16-bit compute (what flash-attn's kernels accept)."""
        return self.compute_dtype in HALF_DTYPES

    @property
    def export_name(self) -> str:
        """"bfloat16", "float16" or "float32" (the spelling of HF configs)."""
        return str(self.export_dtype).removeprefix("torch.")

    def autocast(self) -> contextlib.AbstractContextManager:
        """torch.autocast to the compute dtype on this device type; a null context when computing in fp32 or when
        FSDP casts the parameters (`fsdp_casts`)."""
        if not self.uses_autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute_dtype)

    def apply_backend_settings(self) -> None:
        """Switch fp32 matmuls (and cuDNN convolutions) to TF32 when asked for; nothing in any other mode, so
        torch's defaults (IEEE fp32 matmuls) hold. Uses torch's `fp32_precision` API only: mixing it with the
        legacy `allow_tf32` flags makes torch raise when either is read."""
        if not self.tf32:
            return
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"

    def describe(self) -> str:
        scale = ", dynamic loss scaling" if self.loss_scaling else ""
        compute = "tf32" if self.tf32 else self.peak
        how = " (autocast)" if self.uses_autocast else " (FSDP gathers 16-bit parameters, no autocast)" \
            if self.fsdp_casts else ""
        return (f"precision {self.name} on {self.device_type}: parameters {self.param_dtype}, compute {compute}"
                f"{how}, reduce {self.reduce_dtype}{scale}")


def resolve_precision(dtype: str, device: torch.device | str) -> Precision:
    """The Precision of `model.dtype` (a canonical name, see DTYPE_NAMES) on `device`."""
    if dtype not in _TABLE:
        raise ConfigError(f"model.dtype: expected one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
    device_type = torch.device(device).type
    compute, tf32, peak = _TABLE[dtype]
    tf32 = tf32 and device_type == "cuda"
    if dtype == "torch.tf32" and not tf32:
        peak = "fp32"  # no TF32 units off CUDA: the run computes in IEEE fp32
    return Precision(name=dtype, device_type=device_type, param_dtype=torch.float32, compute_dtype=compute,
                     reduce_dtype=torch.float32, loss_scaling=compute == torch.float16, tf32=tf32,
                     export_dtype=compute, peak=peak)
