"""Numerics resolved once per run: the `Precision` (dtypes, autocast, loss scaling, TF32) and the `Kernels`
(attention, cross entropy, linear, optimizer, gradient reduction) chosen from config, device and layout."""

from .kernels import Kernels, Probes, native_half_gemm, probe_all, select_kernels, select_linear
from .precision import DTYPE_NAMES, Precision, resolve_precision

__all__ = ["DTYPE_NAMES", "Kernels", "Precision", "Probes", "native_half_gemm", "probe_all", "resolve_precision",
           "select_kernels", "select_linear"]
