"""Kernels: which implementation runs attention, cross entropy, linear layers, the optimizer and the gradient
reduction, decided in one place from the config, the precision, the device and the parallel layout.

    kernels = select_kernels(cfg.model, cfg.adam, precision, device, tp=dims.tp, dp=dims.dp, ...)
    # logs one line: "kernels: attention flash, cross entropy flash, ... (why each fallback happened)"

The model, the loss and the optimizer receive these names and probe nothing themselves.

attention       flash         flash-attn 2 (varlen over packed documents); CUDA, 16-bit q/k/v
                torch_varlen  torch's varlen_attn (FA2 kernels inside torch, torch >= 2.11: the same cu_seqlens,
                              windows); CUDA, 16-bit q/k/v: where flash-attn is not installed
                sdpa          torch's scaled_dot_product_attention (dense document mask when packed): the last
                              resort on CUDA, and the kernels line says so
                cpu_blocked   causal attention as blocked matmuls with per-block document masks (the CPU path)
                Under context parallel flash and torch_varlen run every mode on torch's FA2 varlen kernels with
                log-sum-exp (model/context/varlen.py), sdpa and cpu_blocked on the blockwise core.
cross_entropy   flash         flash-attn's Triton kernel (in-place backward); CUDA
                fused_chunked one pass over row chunks: loss, argmax and the logits' gradient (any device)
                fused_chunked_compiled  the same, chunks under torch.compile (model.compile)
                torch         F.cross_entropy on fp32 logits (label smoothing without flash-attn)
                vocab_parallel  torch's loss_parallel over vocabulary-sharded logits (tensor parallel)
linear          onednn        fp32 linear layers on oneDNN's GEMM (CPU); torch: F.linear;
                fp32_gemm     bf16/fp16 linear layers on a CPU without native 16-bit GEMM: fp32 GEMMs, rounded once
                              (`select_linear`: the CPU's feature, `native_half_gemm()`, is its input)
optimizer       apex          NVIDIA apex FusedAdam (plain tensors on CUDA only)
                fused         torch's fused AdamW (CUDA, CPU); foreach: torch's multi-tensor AdamW
grad_reduce     micro_batch   FSDP reduce-scatters every micro-batch (sharded data parallel, as torchtitan)
                step          gradients accumulate over the micro-batches, reduced once per step
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..errors import ConfigError
from ..utils import accelerators, cpu_features
from ..utils.accelerators import Probe
from ..utils.logging import get_logger
from .precision import Precision

logger = get_logger(__name__)

ATTENTION = ("flash", "torch_varlen", "sdpa", "cpu_blocked")
CROSS_ENTROPY = ("flash", "fused_chunked", "fused_chunked_compiled", "torch", "vocab_parallel")
LINEAR = ("onednn", "torch", "fp32_gemm")
OPTIMIZER = ("apex", "fused", "foreach")
GRAD_REDUCE = ("micro_batch", "step")
EXPERT_GEMM = ("loop", "grouped")


@dataclass(frozen=True)
class Kernels:
    """The decision (see the module docstring for the names); `notes` say why a plainer kernel was taken."""

    attention: str
    cross_entropy: str
    linear: str
    optimizer: str
    grad_reduce: str = "step"
    expert_gemm: str = "loop"  # MoE families: one GEMM per expert, or torch's grouped GEMM
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()  # one per installed-but-broken accelerator, logged as a warning

    def describe(self) -> str:
        line = (f"kernels: attention {self.attention}, cross entropy {self.cross_entropy}, linear {self.linear}, "
                f"optimizer {self.optimizer}, gradients reduced every {self.grad_reduce.replace('_', '-')}"
                + (", expert GEMMs grouped" if self.expert_gemm == "grouped" else ""))
        return line + (f" ({'; '.join(self.notes)})" if self.notes else "")


@dataclass(frozen=True)
class Probes:
    """What is installed and working; `probe_all(device_type)` asks utils.accelerators (tests pass their own)."""

    flash_attn: Probe = accelerators.NOT_INSTALLED
    flash_cross_entropy: Probe = accelerators.NOT_INSTALLED
    apex: Probe = accelerators.NOT_INSTALLED
    onednn: bool = False
    native_half_gemm: tuple[torch.dtype, ...] = ()  # 16-bit dtypes this CPU multiplies natively (AVX-512/AMX)
    torch_varlen: Probe = accelerators.NOT_INSTALLED  # torch's varlen_attn and its FA2 kernels (CUDA)


def native_half_gemm() -> tuple[torch.dtype, ...]:
    """The 16-bit dtypes this CPU multiplies natively (AVX-512 BF16 / FP16, AMX: oneDNN's probe), as
    utils.cpu_features.current() holds them (pinnable)."""
    return cpu_features.current().native_half_gemm


def probe_all(device_type: str) -> Probes:
    """Probe only what this device type could use (nothing CUDA-only is imported on a CPU run)."""
    cuda = device_type == "cuda"
    return Probes(
        flash_attn=accelerators.probe_flash_attn(device_type) if cuda else accelerators.NOT_INSTALLED,
        torch_varlen=accelerators.probe_torch_varlen(device_type) if cuda else accelerators.NOT_INSTALLED,
        flash_cross_entropy=accelerators.probe_flash_cross_entropy(device_type) if cuda else accelerators.NOT_INSTALLED,
        apex=accelerators.probe_apex(device_type) if cuda else accelerators.NOT_INSTALLED,
        onednn=device_type == "cpu" and cpu_features.current().onednn_linear,
        native_half_gemm=native_half_gemm())


# package -> (why it does not work, what falls back): one warning per broken package
Fallbacks = dict[str, tuple[str, list[str]]]


def _fall_back(fallbacks: Fallbacks, package: str, probe: Probe, what: str) -> None:
    fallbacks.setdefault(package, (probe.why_not(), []))[1].append(what)


def _requested_attention(requested: str, precision: Precision, device_type: str, probe: Probe, what: str,
                         notes: list[str]) -> str:
    """model.attn_backend 'flash' or 'torch_varlen', asked for by name: it runs, or a ConfigError in one line."""
    if device_type != "cuda":
        raise ConfigError(f"model.attn_backend: {requested!r} requested but the device is {device_type}, not cuda; "
                          f"use 'auto' or 'sdpa'")
    if not probe.ok:
        raise ConfigError(f"model.attn_backend: {requested!r} requested but {what} {probe.why_not()}; "
                          f"use 'auto' or 'sdpa'")
    if not precision.half:
        notes.append(f"{what} under {precision.name}: q/k/v cast to bf16 for the kernel")
    return requested


SDPA_LAST_RESORT = "attention on SDPA: packed rows take a dense [B, 1, T, T] document mask (the last resort)"


def select_attention(requested: str, use_flash_attn: bool, precision: Precision, device_type: str,
                     flash: Probe, notes: list[str], fallbacks: Fallbacks,
                     torch_varlen: Probe = accelerators.NOT_INSTALLED) -> str:
    """model.attn_backend (auto, flash, torch_varlen, sdpa, cpu_blocked) -> the attention kernel. auto on CUDA:
    flash-attn's varlen kernel, else torch's varlen kernel, else SDPA (said in the notes); on CPU cpu_blocked."""
    if requested in ("sdpa", "cpu_blocked"):
        return requested
    if requested == "flash":
        return _requested_attention(requested, precision, device_type, flash, "flash-attn", notes)
    if requested == "torch_varlen":
        return _requested_attention(requested, precision, device_type, torch_varlen,
                                    "torch's varlen attention (torch.nn.attention.varlen)", notes)
    if requested != "auto":
        raise ConfigError(f"model.attn_backend: expected auto, flash, torch_varlen, sdpa or cpu_blocked, "
                          f"got {requested!r}")
    if device_type != "cuda":
        return "cpu_blocked" if device_type == "cpu" else "sdpa"
    if not use_flash_attn:
        notes.append("model.use_flash_attn is False: " + SDPA_LAST_RESORT)
        return "sdpa"
    varlen = torch_varlen.ok and precision.half
    after = "torch's varlen kernel" if varlen else "SDPA"
    if flash.broken:
        _fall_back(fallbacks, "flash-attn", flash, f"attention falls back to {after}")
    elif not flash.ok:
        notes.append(f"flash-attn not installed: attention on {after}")
    elif precision.half:
        return "flash"
    if not precision.half:
        notes.append(f"attention on SDPA: flash-attn takes 16-bit inputs (torch's varlen kernel too) and "
                     f"{precision.name} computes in fp32")
        return "sdpa"
    if varlen:
        return "torch_varlen"
    if torch_varlen.broken:
        _fall_back(fallbacks, "torch's varlen attention", torch_varlen, "attention falls back to SDPA")
    notes.append(SDPA_LAST_RESORT)
    return "sdpa"


def select_cross_entropy(device_type: str, label_smoothing: float, vocab_parallel: bool, compiled: bool,
                         flash_ce: Probe, notes: list[str], fallbacks: Fallbacks) -> str:
    if vocab_parallel:
        return "vocab_parallel"
    if device_type == "cuda" and flash_ce.ok:
        return "flash"
    if label_smoothing == 0:
        choice = "fused_chunked_compiled" if compiled else "fused_chunked"
    else:
        notes.append("cross entropy on torch's kernel: the fused one has no label smoothing")
        choice = "torch"
    if device_type == "cuda" and flash_ce.broken:
        _fall_back(fallbacks, "flash-attn", flash_ce, f"the loss falls back to {choice}")
    return choice


def select_linear(device_type: str, precision: Precision, onednn: bool,
                  native_half_gemm: tuple[torch.dtype, ...], notes: Optional[list[str]] = None) -> str:
    """The linear layers' kernel from the CPU's features (`onednn`: oneDNN's fp32 GEMM usable; `native_half_gemm`:
    the 16-bit dtypes the CPU multiplies natively). 16-bit compute on a CPU without native GEMM for its dtype:
    "fp32_gemm" (fp32 GEMMs, rounded once; its backward holds fp32 copies of the operands). With native GEMM,
    autocast casts the weights itself (F.linear) and caches each cast until its context exits."""
    if device_type == "cpu" and precision.half and precision.compute_dtype not in native_half_gemm:
        if notes is not None:
            notes.append(f"this CPU has no native {str(precision.compute_dtype).removeprefix('torch.')} GEMM: "
                         f"linear layers multiply in fp32 and round once (the numbers of a native kernel)")
        return "fp32_gemm"
    return "onednn" if device_type == "cpu" and onednn else "torch"


def select_optimizer(requested: str, device_type: str, dtensor_params: bool, apex: Probe, notes: list[str],
                     fallbacks: Fallbacks) -> str:
    """adam.fused (auto, torch, apex) -> the AdamW implementation."""
    if requested == "apex":
        if device_type != "cuda":
            raise ConfigError(f"adam.fused: 'apex' requested but the device is {device_type}, not cuda; "
                              f"use 'auto' or 'torch'")
        if not apex.ok:
            raise ConfigError(f"adam.fused: 'apex' requested but NVIDIA apex {apex.why_not()}; use 'auto' or 'torch'")
        if dtensor_params:
            raise ConfigError("adam.fused: 'apex' requested but the parameters are DTensors (FSDP2 data parallel or "
                              "tensor parallel), which apex's multi_tensor_adam cannot read; use 'auto' or 'torch'")
        return "apex"
    if requested not in ("auto", "torch"):
        raise ConfigError(f"adam.fused: expected auto, torch or apex, got {requested!r}")
    if requested == "auto" and device_type == "cuda":
        if apex.ok and not dtensor_params:
            return "apex"
        if apex.broken:
            _fall_back(fallbacks, "NVIDIA apex", apex, "AdamW falls back to torch's fused kernel")
        elif apex.ok:
            notes.append("apex not used: the parameters are DTensors")
    return "fused" if device_type in ("cuda", "cpu") else "foreach"


def select_grad_reduce(dp: int, dp_shard: int, pp: int, micro_num: int, notes: list[str]) -> str:
    """Sharded data parallel reduce-scatters every micro-batch: skipping it would keep every parameter's
    gradient unsharded in fp32 until the last micro-batch (4 bytes per parameter, 27 GiB for 7B). Replicated
    data parallel loses no memory by waiting and all-reduces once. Under pipeline parallel the stages do the
    same (parallel/pipeline.py overrides torch's schedule, which would accumulate)."""
    if dp == 1 or micro_num == 1 or dp_shard == 1:
        return "step"
    notes.append(f"{micro_num} reduce-scatters per step: sharded gradients accumulate, unsharded ones are not kept")
    return "micro_batch"


def select_expert_gemm(requested: str, device_type: str, compute_dtype: torch.dtype, notes: list[str],
                       grouped_runs: Optional[bool] = None) -> str:
    """moe.expert_gemm (auto, loop, grouped) -> how the MoE layers multiply their experts.

    auto: torch's grouped GEMM (`torch._grouped_mm`: one kernel for every local expert) on CUDA when it runs for the
    compute dtype (bf16 on Hopper and later), the per-expert loop otherwise. On the CPU the loop is kept: its GEMMs
    are the package's CPU-aware linear (oneDNN, fp32 GEMMs for 16-bit weights without native bf16), which the CPU
    grouped GEMM is not, and it measured no faster here (bench/moe.py). "grouped" asked for where it does not run
    is a ConfigError; the layer still loops for a micro-batch whose shapes it cannot take (unaligned widths).
    grouped_runs: whether the grouped GEMM runs here (default: probed once with a tiny GEMM on the device)."""
    if requested not in ("auto",) + EXPERT_GEMM:
        raise ConfigError(f"moe.expert_gemm: expected auto, loop or grouped, got {requested!r}")
    available = grouped_runs
    if available is None:
        from ..model.moe.experts import grouped_mm_available  # probes a tiny GEMM on the device once
        available = device_type not in ("meta", "cuda") or torch.cuda.is_available()
        available = available and grouped_mm_available(torch.device(device_type), compute_dtype)
    if requested == "grouped" and not available:
        raise ConfigError(f"moe.expert_gemm: 'grouped' requested but torch {torch.__version__}'s grouped GEMM does "
                          f"not run for {compute_dtype} on {device_type}; use auto or loop")
    if requested == "auto":
        if device_type == "cuda" and available:
            return "grouped"
        notes.append("expert GEMMs loop per expert" + ("" if device_type == "cpu" else
                                                        f" (no grouped GEMM for {compute_dtype} here)"))
        return "loop"
    return requested


def select_kernels(model_cfg: Any, adam_cfg: Any, precision: Precision, device: torch.device | str, tp: int = 1,
                   dp: int = 1, dp_shard: int = 1, pp: int = 1, micro_num: int = 1, label_smoothing: float = 0.0,
                   probes: Optional[Probes] = None, log: bool = True, moe_cfg: Any = None) -> Kernels:
    """Every kernel choice of a run (see the module docstring), with one log line saying what and why.

    model_cfg: the `model` section (attn_backend, use_flash_attn, compile, parallel_output);
    adam_cfg: the `adam` section (fused); moe_cfg: the `moe` section of a MoE family (expert_gemm), else None. Parameters are DTensors whenever dp > 1 (FSDP2) or tp > 1.
    An accelerator that is installed but broken falls back with one warning; one that was asked for
    explicitly and cannot run is a ConfigError naming the key.
    """
    device_type = torch.device(device).type
    probes = probes if probes is not None else probe_all(device_type)
    notes: list[str] = []
    fallbacks: Fallbacks = {}
    attention = select_attention(model_cfg.attn_backend, model_cfg.use_flash_attn, precision, device_type,
                                 probes.flash_attn, notes, fallbacks, probes.torch_varlen)
    cross_entropy = select_cross_entropy(device_type, label_smoothing, tp > 1 and model_cfg.parallel_output,
                                         model_cfg.compile, probes.flash_cross_entropy, notes, fallbacks)
    linear = select_linear(device_type, precision, probes.onednn, probes.native_half_gemm, notes)
    optimizer = select_optimizer(adam_cfg.fused, device_type, dp > 1 or tp > 1, probes.apex, notes, fallbacks)
    grad_reduce = select_grad_reduce(dp, dp_shard, pp, micro_num, notes)
    expert_gemm = "loop" if moe_cfg is None else select_expert_gemm(moe_cfg.expert_gemm, device_type,
                                                                    precision.compute_dtype, notes)
    kernels = Kernels(attention, cross_entropy, linear, optimizer, grad_reduce, expert_gemm, tuple(notes),
                      tuple(f"{package} {why}: {', '.join(what)}" for package, (why, what) in fallbacks.items()))
    if log:
        for warning in kernels.warnings:
            logger.warning(warning)
        logger.info(kernels.describe())
    return kernels
