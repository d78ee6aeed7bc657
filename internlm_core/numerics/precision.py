"""Precision: the dtypes of one run, resolved once from `model.dtype` and the device.

    precision = resolve_precision(cfg.model.dtype, device)
    precision.apply_backend_settings()        # TF32 on CUDA for torch.tf32, nothing otherwise
    with precision.autocast():                # bf16/fp16 autocast; nothing for fp32/tf32
        ...

This is the only table from dtype names to torch dtypes; the config only normalizes spellings
(`bf16` -> `torch.bfloat16`) and checks the name is one of `DTYPE_NAMES`.
"""

from __future__ import annotations

import contextlib
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
    compute_dtype: matmuls and activations (under autocast when it differs from param_dtype).
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

    @property
    def uses_autocast(self) -> bool:
        return self.compute_dtype != self.param_dtype

    @property
    def half(self) -> bool:
        """16-bit compute (what flash-attn's kernels accept)."""
        return self.compute_dtype in HALF_DTYPES

    @property
    def export_name(self) -> str:
        """"bfloat16", "float16" or "float32" (the spelling of HF configs)."""
        return str(self.export_dtype).removeprefix("torch.")

    def autocast(self) -> contextlib.AbstractContextManager:
        """torch.autocast to the compute dtype on this device type; a null context when computing in fp32."""
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
        return (f"precision {self.name} on {self.device_type}: parameters {self.param_dtype}, compute {compute}"
                f"{' (autocast)' if self.uses_autocast else ''}, reduce {self.reduce_dtype}{scale}")


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
