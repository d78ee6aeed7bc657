"""The experts' SwiGLU weights and their GEMMs: one GEMM per expert ("loop") or torch's grouped GEMM ("grouped").

Rows arrive grouped by expert (counts[i] rows for local expert i, in order); each expert computes
w2(silu(w1 x) * w3 x). The weights are [E_local, ...] tensors, or DTensors whose to_local() are this rank's experts
(expert parallel: Shard(0) over the expert-parallel mesh), so one parameter holds every local expert and FSDP /
checkpoints see three tensors per layer.

torch's grouped GEMM: `torch._grouped_mm` (exposed as `torch.nn.functional.grouped_mm` in torch 2.13) takes 2D
rows, 3D weights [G, K, N] and int32 end offsets per group, and is differentiable. In torch 2.13 it runs on the CPU
for fp32, bf16 and fp16, and on CUDA for bf16 (SM >= 80); every operand's row stride must be a multiple of 16 bytes,
and its fake (meta) kernel accepts bf16 only, so under torch.compile only bf16 takes it. Whether a device/dtype has
it is probed once (forward and backward on a tiny case) rather than assumed, since torch 2.11 and 2.12 differ; where
it is missing or the shapes are not aligned the loop runs.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...utils.transfer import to_device
from ...errors import ConfigError
from ..layers import Linear, linear, weight_subclass
from .router import local_tensor

_GROUPED_OK: dict[tuple[str, torch.dtype], bool] = {}


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM runs forward and backward for this device type and dtype (a tiny case)."""
    op = getattr(torch, "_grouped_mm", None)
    if op is None:
        return False
    try:
        x = torch.ones(4, 16, device=device, dtype=dtype, requires_grad=True)
        w = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
        y = op(x, w, offs=torch.tensor([1, 4], device=device, dtype=torch.int32))
        y.backward(torch.ones_like(y))
        return bool(torch.isfinite(y).all()) and w.grad is not None
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """torch's grouped GEMM exists for this device type and dtype (probed once per pair; under torch.compile
    bf16 only, the one dtype its fake kernel accepts)."""
    if torch.compiler.is_compiling():
        return dtype == torch.bfloat16 and _GROUPED_OK.get((device.type, dtype), False)
    key = (device.type, dtype)
    if key not in _GROUPED_OK:
        _GROUPED_OK[key] = _probe_grouped_mm(device, dtype)
    return _GROUPED_OK[key]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the expert GEMMs run in: autocast's when it is on for x's device, x's own otherwise."""
    if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class GroupedExperts(nn.Module):
    """Every local expert's SwiGLU: w1, w3 [E, ffn, h] and w2 [E, h, ffn] (Mixtral's naming: w2 is the down
    projection), initialized N(0, init_std)."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_width: int, gemm: str = "loop",
                 init_std: float = 0.02):
        super().__init__()
        self.gemm = gemm
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn_width, hidden_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn_width, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_width))
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=init_std)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The local experts' (w1, w3, w2) as plain tensors (DTensors' local parts)."""
        return local_tensor(self.w1), local_tensor(self.w3), local_tensor(self.w2)

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows [N, h] grouped by local expert (counts[i] rows for expert i) -> [N, h] in the compute dtype."""
        w1, w3, w2 = self.weights()
        if len(counts) != w1.shape[0]:
            raise ValueError(f"{len(counts)} row counts for {w1.shape[0]} local experts")
        if rows.shape[0] == 0:
            # no rows, but the output still depends on the rows and the weights: under expert parallel the rows
            # came from an all-to-all whose backward (a collective) must run on every rank, and every rank's
            # weights get a (zero) gradient
            zero = 0 * (rows.sum() + w1.sum() + w3.sum() + w2.sum())
            return rows.new_zeros(0, rows.shape[1], dtype=_compute_dtype(rows)) + zero
        if self.gemm == "grouped" and self._grouped_fits(rows, w1):
            return self._grouped(rows, counts, w1, w3, w2)
        if weight_subclass(w1):  # a low-precision wrapper (model.fp8 mxfp8) overrides the grouped GEMM only
            raise ConfigError(f"model.fp8: the experts' weights are {type(w1).__name__}, which only the grouped GEMM "
                              f"honours, but these rows ({tuple(rows.shape)}, {rows.dtype}) take the per-expert loop")
        return self._loop(rows, counts, w1, w3, w2)

    def _grouped_fits(self, rows: torch.Tensor, w1: torch.Tensor) -> bool:
        dtype = _compute_dtype(rows)
        align = 16 // torch.empty((), dtype=dtype).element_size()  # elements per 16 bytes
        aligned = dtype.is_floating_point and rows.shape[1] % align == 0 and w1.shape[1] % align == 0
        return aligned and grouped_mm_available(rows.device, dtype)

    @staticmethod
    def _grouped(rows: torch.Tensor, counts: list[int], w1: torch.Tensor, w3: torch.Tensor,
                 w2: torch.Tensor) -> torch.Tensor:
        """One grouped GEMM per projection over every local expert (operands cast to the compute dtype)."""
        dtype = _compute_dtype(rows)
        ends = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32)
        # through pinned memory on CUDA (a pageable copy makes the host wait); traced as a plain constant
        offs = ends.to(rows.device) if torch.compiler.is_compiling() else to_device(ends, rows.device)
        with torch.autocast(rows.device.type, enabled=False):
            x = rows.to(dtype)
            h1 = torch._grouped_mm(x, w1.to(dtype).transpose(-2, -1), offs=offs)
            h3 = torch._grouped_mm(x, w3.to(dtype).transpose(-2, -1), offs=offs)
            # .to(dtype): a low-precision grouped GEMM may return its own dtype (torchao's MXFP8: bf16)
            return torch._grouped_mm(F.silu(h1) * h3, w2.to(dtype).transpose(-2, -1), offs=offs).to(dtype)

    @staticmethod
    def _loop(rows: torch.Tensor, counts: list[int], w1: torch.Tensor, w3: torch.Tensor,
              w2: torch.Tensor) -> torch.Tensor:
        """One GEMM per expert and projection (the package's CPU-aware `linear`; autocast applies as for a dense
        layer). unbind, not indexing: its backward stacks the experts' gradients once, zeros for an expert without
        rows (skipped: oneDNN's GEMM refuses empty operands)."""
        outs = []
        for x, a, b, c in zip(rows.split(counts), w1.unbind(0), w3.unbind(0), w2.unbind(0)):
            if x.shape[0]:
                outs.append(linear(F.silu(linear(x, a)) * linear(x, b), c))
        return torch.cat(outs, dim=0)


class SharedExperts(nn.Module):
    """The dense SwiGLU beside the routed experts (InternEvo's residual_mlp): w1, w3 [width, h], w2 [h, width]
    as Linear modules (`shared_experts.w1.weight`, ...), so a tensor-parallel plan shards them like a dense FFN."""

    def __init__(self, hidden_size: int, width: int, init_std: float = 0.02):
        super().__init__()
        self.w1 = Linear(hidden_size, width, bias=False)
        self.w3 = Linear(hidden_size, width, bias=False)
        self.w2 = Linear(width, hidden_size, bias=False)
        for m in (self.w1, self.w3, self.w2):
            nn.init.normal_(m.weight, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
