"""The CPU features that kernel choices and memory figures depend on, probed in one place and pinnable.

A CPU with native 16-bit GEMM (AVX-512 BF16 / FP16, AMX) multiplies bf16 in bf16; one without runs the linear
layers' GEMMs in fp32 and rounds once (model/layers.py HalfLinearFp32Gemm), whose backward holds fp32 copies of
its operands: the estimator counts them (estimate/, `gemm_copies`). oneDNN's fp32 GEMM, where torch ships it,
runs fp32 linear layers. What these decide (the `linear` kernel, the activation bytes) is a function of a
`CpuFeatures` value, never of the machine directly:

    features = current()                 # this machine's (probed once), unless pinned
    with pinned(CpuFeatures.NATIVE):     # behave as on an AMX CPU: kernels, numerics' probes, the estimator
        ...

`estimate.estimate(..., cpu=...)` also takes the value explicitly. Tests that assert a figure computed from it pin
it (tests/unit/test_memory_fit.py, test_estimate.py), so that it is the same on every CPU, and test both settings.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar, Iterator, Optional

import torch

HALF_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class CpuFeatures:
    """native_half_gemm: the 16-bit dtypes the CPU multiplies natively; onednn_linear: oneDNN's fp32 GEMM op
    (`mkldnn._linear_pointwise`) is in this torch build."""

    native_half_gemm: tuple[torch.dtype, ...] = ()
    onednn_linear: bool = False

    NATIVE: ClassVar["CpuFeatures"]    # e.g. Sapphire Rapids (AMX): bf16 and fp16 GEMMs, oneDNN
    EMULATED: ClassVar["CpuFeatures"]  # e.g. an AVX2 EPYC: oneDNN, but 16-bit GEMMs emulated (~100x slower)

    def upcasts(self, dtype: torch.dtype) -> bool:
        """Linear layers of this 16-bit dtype run their GEMMs in fp32 (no native GEMM for it)."""
        return dtype in HALF_DTYPES and dtype not in self.native_half_gemm


CpuFeatures.NATIVE = CpuFeatures(HALF_DTYPES, True)
CpuFeatures.EMULATED = CpuFeatures((), True)


def detect() -> CpuFeatures:
    """This machine's features (oneDNN's own probes; a torch build without them: none), probed once at import."""
    return _DETECTED


def _probe() -> CpuFeatures:
    onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    try:
        native = (torch.bfloat16,) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else ()
        native += (torch.float16,) if torch.ops.mkldnn._is_mkldnn_fp16_supported() else ()
    except (AttributeError, RuntimeError):
        native = ()
    return CpuFeatures(native, bool(onednn))


# Probed at import, a plain module constant: the linear layers read it inside compiled blocks, where torch.compile
# would otherwise trace the probes themselves (an lru_cache is not honoured by dynamo).
_DETECTED: CpuFeatures = _probe()
_pinned: Optional[CpuFeatures] = None


def current() -> CpuFeatures:
    """The features kernels and the estimator decide from: the pinned ones, else this machine's."""
    return _pinned if _pinned is not None else _DETECTED


def pin(features: Optional[CpuFeatures]) -> Optional[CpuFeatures]:
    """Decide from `features` from now on (None: this machine's again); returns what was pinned before."""
    global _pinned
    before, _pinned = _pinned, features
    return before


@contextlib.contextmanager
def pinned(features: CpuFeatures) -> Iterator[CpuFeatures]:
    """`features` inside the block, the previous setting after it."""
    before = pin(features)
    try:
        yield features
    finally:
        pin(before)
