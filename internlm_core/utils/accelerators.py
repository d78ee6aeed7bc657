"""Probes for the optional accelerators (flash-attn, NVIDIA apex, oneDNN's GEMM): importable AND working.

`importlib.util.find_spec` only proves that a package folder exists. A flash-attn wheel built for another
torch fails with ImportError (an undefined symbol) at its first import; an apex built without its CUDA
extensions raises in `FusedAdam.__init__`. A probe imports the entry points the code uses and, on a CUDA
device, runs each once on a tiny input. Each probe runs at most once per process and device type (cached);
`numerics.kernels.select_kernels` reads them, nothing else does.

`bind_thread_device`: the current device is per thread on CUDA (a new thread starts on device 0), so a thread that
calls into a library that captures "the current device" (torchft's quorum and commit) sets its rank's device first.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Probe:
    """What a probe found: `installed` (a package is there), `ok` (it imports and ran), `detail` (why not)."""

    installed: bool
    ok: bool
    detail: str = ""

    @property
    def broken(self) -> bool:
        """Installed but not working: the case that must fall back with a warning instead of crashing later."""
        return self.installed and not self.ok

    def why_not(self) -> str:
        """'is not installed' or 'is installed but does not work (<error>)', for messages."""
        return "is not installed" if not self.installed else f"is installed but does not work ({self.detail})"


NOT_INSTALLED = Probe(installed=False, ok=False, detail="not installed")
WORKING = Probe(installed=True, ok=True)


def _error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


@functools.lru_cache(maxsize=None)
def probe_flash_attn(device_type: str) -> Probe:
    """flash-attn 2's attention kernels: import both entry points; on CUDA one tiny bf16 varlen forward."""
    if importlib.util.find_spec("flash_attn") is None:
        return NOT_INSTALLED
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func  # noqa: F401
        if device_type == "cuda":
            q = torch.randn(8, 2, 64, device="cuda", dtype=torch.bfloat16)
            cu = torch.tensor([0, 3, 8], device="cuda", dtype=torch.int32)
            flash_attn_varlen_func(q, q, q, cu, cu, 5, 5, causal=True)
            torch.cuda.synchronize()
    except Exception as e:  # ImportError (undefined symbol), RuntimeError (no kernel for this GPU), ...
        return Probe(installed=True, ok=False, detail=_error(e))
    return WORKING


@functools.lru_cache(maxsize=None)
def probe_flash_cross_entropy(device_type: str) -> Probe:
    """flash-attn's Triton cross entropy: import; on CUDA one tiny forward and backward."""
    if importlib.util.find_spec("flash_attn") is None:
        return NOT_INSTALLED
    try:
        from flash_attn.losses.cross_entropy import CrossEntropyLoss
        if device_type == "cuda":
            x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            CrossEntropyLoss(reduction="none", inplace_backward=True)(
                x * 1, torch.tensor([1, 2, -100, 3], device="cuda")).sum().backward()
            torch.cuda.synchronize()
    except Exception as e:
        return Probe(installed=True, ok=False, detail=_error(e))
    return WORKING


@functools.lru_cache(maxsize=None)
def probe_torch_varlen(device_type: str) -> Probe:
    """torch's own varlen attention: `torch.nn.attention.varlen.varlen_attn` (torch >= 2.11) over the FA2 kernels
    built into torch (`aten._flash_attention_forward/backward`, which the context-parallel path calls with the
    log-sum-exp). CUDA only; there one tiny bf16 forward and backward with GQA and a window (a build without them,
    or a GPU older than sm80, fails here)."""
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return NOT_INSTALLED
    if device_type != "cuda":
        return Probe(installed=True, ok=False, detail=f"no varlen kernel on {device_type} (CUDA only)")
    try:
        from torch.nn.attention.varlen import varlen_attn
        q = torch.randn(8, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(8, 2, 64, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0, 3, 8], device="cuda", dtype=torch.int32)
        varlen_attn(q, q.detach(), q.detach(), cu, cu, 5, 5, window_size=(2, 0)).sum().backward()
        out, lse = torch.ops.aten._flash_attention_forward(q.detach(), kv, kv, cu, cu, 5, 5, 0.0, False, False,
                                                           window_size_left=1, window_size_right=-1)[:2]
        torch.ops.aten._flash_attention_backward(out, q.detach(), kv, kv, out, lse, cu, cu, 5, 5, 0.0, False,
                                                 torch.zeros(2, dtype=torch.uint64, device="cuda"),
                                                 torch.empty(0, device="cuda"), window_size_left=1,
                                                 window_size_right=-1)
        torch.cuda.synchronize()
    except Exception as e:  # RuntimeError: no flash kernel in this build / for this GPU
        return Probe(installed=True, ok=False, detail=_error(e))
    return WORKING


@functools.lru_cache(maxsize=None)
def probe_apex(device_type: str) -> Probe:
    """NVIDIA apex's FusedAdam with its CUDA extension (the PyPI package named apex is an unrelated web
    toolkit): import, check the multi-tensor extension, and on CUDA one step on a 1-element parameter."""
    if importlib.util.find_spec("apex") is None or importlib.util.find_spec("apex.optimizers") is None:
        return NOT_INSTALLED
    try:
        from apex.multi_tensor_apply import multi_tensor_applier
        from apex.optimizers import FusedAdam
        if not multi_tensor_applier.available:
            return Probe(installed=True, ok=False, detail="apex was built without its CUDA extensions (amp_C)")
        if device_type == "cuda":
            p = torch.nn.Parameter(torch.ones(1, device="cuda"))
            p.grad = torch.ones_like(p)
            FusedAdam([p], lr=1e-3).step()
            torch.cuda.synchronize()
    except Exception as e:
        return Probe(installed=True, ok=False, detail=_error(e))
    return WORKING


def bind_thread_device(device: torch.device) -> bool:
    """Make `device` the calling thread's current device; False (nothing set) for the CPU and other devices without
    a current-device notion. CUDA keeps the current device per host thread and a new thread starts on device 0:
    without this, torchft's start_quorum (which passes `torch.accelerator.current_device_index()` to its quorum
    thread, where the replica communicator connects) and should_commit (which synchronizes the current stream)
    would use GPU 0 on every rank."""
    if device.type in ("cpu", "meta"):
        return False
    if device.index is None:
        raise ValueError(f"bind_thread_device: expected a device with an index (cuda:N), got {device}")
    torch.accelerator.set_device_index(device.index)  # torch >= 2.6: CUDA, XPU, ... alike
    return True


def clear_probe_cache() -> None:
    """Forget every probe result (tests that install or break a fake package)."""
    for fn in (probe_flash_attn, probe_flash_cross_entropy, probe_apex, probe_torch_varlen):
        fn.cache_clear()
