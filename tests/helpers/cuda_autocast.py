"""CUDA autocast's norm rule, on the CPU: a test mode.

CUDA's autocast runs `rms_norm` and `layer_norm` in fp32 and hands their fp32 outputs on; the CPU's autocast leaves
them in their input's dtype. A CPU run therefore never sees the fp32 q/k that Qwen3's q/k norms give under CUDA
autocast, nor the fp32 norm outputs that feed the next layers there. Inside `cuda_norm_rules()`, a bf16/fp16
autocast on the CPU follows CUDA's rule: every `aten::rms_norm` / `aten::layer_norm` called with autocast on
(F.rms_norm, F.layer_norm, nn.RMSNorm, nn.LayerNorm, and the package's norms unless they switch autocast off) casts
its floating inputs to fp32 and returns fp32, as CUDA's fp32 cast policy does. Outside autocast nothing changes,
and the backward, which the trainer runs outside autocast (as CUDA's engine does), is the plain one.

    with cuda_norm_rules(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids)          # norms return fp32, as on a GPU
    out.float().sum().backward()  # outside autocast

The rule is a kernel registered for the AutocastCPU dispatch key (torch.library), removed on exit. A driver run
under it (`python tests/helpers/cuda_autocast.py SCRIPT ARGS...`) runs SCRIPT (train.py) with the rule on.
"""

from __future__ import annotations

import contextlib
import runpy
import sys
import warnings
from pathlib import Path
from typing import Iterator, Optional

import torch

_DEPTH = 0
_LIB: Optional[torch.library.Library] = None


def _fp32(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return t.float() if t is not None and t.is_floating_point() else t


def _rms_norm(x, normalized_shape, weight=None, eps=None):
    with torch.autocast("cpu", enabled=False):  # what CUDA's fp32 policy does: cast, then the plain kernel
        return torch.ops.aten.rms_norm(_fp32(x), normalized_shape, _fp32(weight), eps)


def _layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    with torch.autocast("cpu", enabled=False):
        return torch.ops.aten.layer_norm(_fp32(x), normalized_shape, _fp32(weight), _fp32(bias), eps, cudnn_enable)


@contextlib.contextmanager
def cuda_norm_rules() -> Iterator[None]:
    """Within it, CPU autocast runs rms_norm and layer_norm in fp32 and returns fp32 (CUDA's rule); nestable."""
    global _DEPTH, _LIB
    if _DEPTH == 0:
        _LIB = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel": that is the point
            _LIB.impl("rms_norm", _rms_norm, "AutocastCPU")
            _LIB.impl("layer_norm", _layer_norm, "AutocastCPU")
    _DEPTH += 1
    try:
        yield
    finally:
        _DEPTH -= 1
        if _DEPTH == 0 and _LIB is not None:
            _LIB._destroy()
            _LIB = None


def cuda_rules_fixture():
    """A pytest fixture body: `cuda_rules = pytest.fixture(cuda_rules_fixture)` in a test module."""
    with cuda_norm_rules():
        yield


if __name__ == "__main__":
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    with cuda_norm_rules():
        runpy.run_path(script, run_name="__main__")
