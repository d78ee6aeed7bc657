"""The rows of the GPU check (bench/gpu_paths.py runs them, tools/gpu_check.sh caps them at 7 minutes).

Each row is `fn(out) -> (ok, result, detail)` on the machine's first GPU, with the torch that is installed (nothing is
installed here: the GPU machines have no package registry). `ROWS` is the order: flash-attn and apex first (only
where importable), then the trainer's real GPU paths.
"""

from __future__ import annotations

import gc
import json
import math
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from gpu_rows_varlen import row_varlen_contract
from gpu_rows_offload import row_offload
from gpu_rows_fp8 import row_fp8_speed
from gpu_rows_fused_head import row_fused_head
from gpu_rows_numerics import (compare_attention, row_context_mixed_dtypes, row_moe_grouped_sync,
                               row_norm_autocast, row_torch_api_test)
from gpu_rows_speed import row_speed_compiled, row_speed_eager

ROOT = Path(__file__).resolve().parents[1]
SUPPORTED_TORCH = ((2, 11), (2, 15))  # requirements.txt and README state the same range
CUDA = torch.device("cuda", 0)


@dataclass(frozen=True)
class Row:
    name: str
    fn: Callable[[Path], tuple[bool, str, str]]
    budget_s: int           # the most it may take on an H100/H200; it does not start with less time left
    cuda: bool = True       # needs a CUDA device
    when: Optional[str] = None  # a module that must be importable for the row to be promised (flash_attn, apex)


def cuda_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def release_memory() -> None:
    gc.collect()
    if cuda_available():
        torch.cuda.empty_cache()


def _tiny(dtype: str, *overrides: str):
    from internlm_core.config import load_config
    return load_config(str(ROOT / "configs/tiny.py"), [
        f"model.dtype={dtype}", "data.micro_num=2", "data.valid_every=0", "monitor.tensorboard=False",
        "data.empty_cache_and_diag_interval=0", "ckpt.enable_save_ckpt=False", *overrides])


def _trainer(cfg, run_dir: Path, callbacks=()):
    from internlm_core.distributed import LaunchInfo
    from internlm_core.trainer.build import build_trainer
    torch.cuda.set_device(CUDA)
    run_dir.mkdir(parents=True, exist_ok=True)
    return build_trainer(cfg, LaunchInfo("none", 0, 1, 0, CUDA, None), run_dir, extra_callbacks=list(callbacks))


# ---- accelerators (first, where importable) ------------------------------------------------------------------------

def _attention_pair(backend: str, other: str) -> tuple[bool, str, str]:
    """`backend` in bf16 against `other` in fp32 on one packed batch (mixed document lengths, grouped-query heads):
    the output and each of dq, dk, dv within its own allowance (bench/gpu_rows_numerics.tensor_errors: dv is ~5x
    the output, one tolerance from the output's max failed two correct kernels)."""
    return compare_attention(backend, other, CUDA)


def row_flash_attention(out: Path):
    from internlm_core.utils.accelerators import probe_flash_attn
    p = probe_flash_attn("cuda")
    if not p.ok:
        return False, f"flash-attn {p.why_not()}", ""
    return _attention_pair("flash", "sdpa")


def _loss_rows(kernels: list[str], n: int = 8192, v: int = 32000) -> tuple[bool, str, str]:
    """Each kernel in bf16 and fp16 under a 2**16/4 loss scale against fp32: no gradient entry lost, error near one
    16-bit rounding."""
    from internlm_core.loss import FlashGPTLMLoss
    g = torch.Generator().manual_seed(0)
    base = 2 * torch.randn(n, v, generator=g)
    y = torch.randint(0, v, (n,), generator=g)
    y[::9] = -100
    y = y.to(CUDA)
    scale, results, ok = 2.0**16 / 4, [], True
    for dtype in (torch.bfloat16, torch.float16):
        x16 = base.to(CUDA, dtype)
        xr = x16.float().requires_grad_()
        (F.cross_entropy(xr, y, ignore_index=-100) * scale).backward()
        fi = torch.finfo(dtype)
        holds, normal = xr.grad.abs() >= fi.tiny * fi.eps, xr.grad.abs() >= fi.tiny
        for kernel in kernels:
            x = (x16.clone() * 1).requires_grad_()  # * 1: flash's in-place backward writes into a non-leaf
            x.retain_grad()
            loss, _ = FlashGPTLMLoss(kernel)(x, y)
            (loss * scale).backward()
            got = x.grad.float()
            lost = int(((got == 0) & holds).sum())
            rel = ((got - xr.grad).abs() / xr.grad.abs())[normal].max().item()
            ok = ok and lost == 0 and rel <= 2.5 * fi.eps
            results.append(f"{kernel} {str(dtype)[6:]}: {lost} lost, rel {rel:.1e}")
    return ok, "; ".join(results), f"{n}x{v}, scale {scale:g}"


def row_flash_cross_entropy(out: Path):
    from internlm_core.utils.accelerators import probe_flash_cross_entropy
    p = probe_flash_cross_entropy("cuda")
    if not p.ok:
        return False, f"flash-attn's cross entropy {p.why_not()}", ""
    return _loss_rows(["flash"])


def row_apex(out: Path):
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    from internlm_core.config.schema import AdamConfig
    from internlm_core.optim import build_optimizer
    from internlm_core.utils.accelerators import probe_apex
    p = probe_apex("cuda")
    if not p.ok:
        return False, f"apex {p.why_not()}", ""
    model = torch.nn.Linear(256, 256).to(CUDA)
    opt = build_optimizer(model, AdamConfig(), "apex")
    _init_optim_state(opt)
    model(torch.randn(4, 256, device=CUDA)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return all(q.grad is None for q in model.parameters()), "step + zero_grad(set_to_none=True)", \
        "and DCP's optimizer-state initialization (resume)"


# ---- the machine, the kernels it is given --------------------------------------------------------------------------

def row_environment(out: Path):
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    low, high = SUPPORTED_TORCH
    name = torch.cuda.get_device_name(CUDA)
    ok = low <= version <= high
    return ok, f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}", \
        f"supported torch {low[0]}.{low[1]}-{high[0]}.{high[1]}" + ("" if ok else ": OUTSIDE the supported range")


def row_torch_api(out: Path):
    """Every torch name the code uses (tools/torch_api_names.py's scan) resolves in the torch installed here: the
    runtime side of tests/unit/test_torch_api.py, which checks them against the supported versions' sources."""
    sys.path.insert(0, str(ROOT / "tools"))
    import torch_api_names
    uses = torch_api_names.package_uses()
    found = torch_api_names.missing_installed(uses)
    (out / "torch_api_missing.txt").write_text("".join(f"{line}\n" for line in found))
    return not found, f"{len({u.chain for u in uses})} names, {len(found)} missing in torch {torch.__version__}", \
        (f"first: {found[0]} (all: torch_api_missing.txt)" if found else "each one imported or looked up")


def row_kernels(out: Path):
    from internlm_core.config import load_config
    from internlm_core.numerics import resolve_precision, select_kernels
    cfg = load_config(str(ROOT / "configs/bench_gpu.py"))
    chosen, ok = [], True
    for dtype in ("torch.bfloat16", "torch.float32"):
        k = select_kernels(cfg.model, cfg.adam, resolve_precision(dtype, CUDA), CUDA, log=False)
        ok = ok and (dtype != "torch.float32" or k.attention != "flash")  # fp32 never reaches flash-attn
        chosen.append(f"{dtype[6:]}: {k.attention}/{k.cross_entropy}/{k.linear}/{k.optimizer}")
    close, sdpa_vs_blocked, _ = _attention_pair("sdpa", "cpu_blocked")
    return ok and close, "; ".join(chosen), f"attention sdpa vs the blocked kernel on one packed bf16 batch: " \
                                             f"{sdpa_vs_blocked}"


def row_loss_kernels(out: Path):
    return _loss_rows(["fused_chunked", "torch"])


def row_init(out: Path):
    """A 4096x4096 parameter drawn on the GPU equals the CPU draw bitwise (the counter-based init: every layout and
    device the same weights); the time of both."""
    from internlm_core.model.init import ShardValues, parameter_generator
    n, times, values = 4096, {}, {}
    for device in (CUDA, torch.device("cpu")):
        local = torch.empty(n, n, device=device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ShardValues(local, [torch.arange(n), torch.arange(n)], (n, n), parameter_generator(1024, "w")).normal_(
            0.0, 0.02)
        torch.cuda.synchronize()
        times[device.type], values[device.type] = time.perf_counter() - t0, local.cpu()
    same = torch.equal(values["cuda"], values["cpu"])
    return same, ("bitwise equal to the CPU draw" if same else
                  f"differs from the CPU draw in {int((values['cuda'] != values['cpu']).sum())} elements"), \
        f"4096x4096: {times['cuda'] * 1e3:.0f} ms on the GPU, {times['cpu']:.2f} s on the CPU"


# ---- NCCL: a pipeline stage without outputs ------------------------------------------------------------------------

def row_nccl_stage(out: Path):
    """One NCCL rank plays a non-last pipeline stage: the loop's per-step collectives (metric, loss, inf/nan flag,
    gradient norm, stop poll, straggler check) run on it; a host tensor is refused, as the first step of a pipeline
    run was (NCCL takes CUDA tensors only)."""
    import torch.distributed as dist

    from internlm_core.utils import collectives
    from tests.helpers.stage_collectives import expected_non_last_alone, stage_step_collectives, summary
    torch.cuda.set_device(CUDA)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=CUDA)
    try:
        world = dist.group.WORLD
        dims = SimpleNamespace(dp=1, pp=2, group=lambda name: world)  # the one rank stands for pp_dp and pp
        got = summary(stage_step_collectives(CUDA, last=False, dims=dims, world_size=2, rank=0))
        want = expected_non_last_alone()
        same = all(math.isclose(float(got[k]), float(want[k]), rel_tol=1e-6) for k in want)
        refused = []
        for name, call in (("NCCL", lambda t: dist.all_reduce(t)), ("utils.collectives",
                                                                     lambda t: collectives.all_reduce(t))):
            try:
                call(torch.zeros(3))
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - what NCCL raises for a host tensor varies by version
                refused.append(f"{name}: {type(e).__name__}")
    finally:
        dist.destroy_process_group()
    return same and len(refused) == 2, "per-step collectives of a stage without outputs ran" if same else \
        f"got {got}, expected {want}", "a host tensor refused by " + (", ".join(refused) or "nobody")


# ---- real trainer steps under the sync debug mode ------------------------------------------------------------------

class SyncWindow:
    """Counts host synchronizations (torch.cuda.set_sync_debug_mode("warn") warnings) inside each step's
    micro-batch loop (first forward to last backward) and in the whole step."""

    def __init__(self, caught: list):
        from internlm_core.callbacks import TrainerCallback

        window = self

        class Hook(TrainerCallback):
            def on_before_forward(self, trainer):
                if window.start is None:
                    window.start = len(caught)

            def on_after_backward(self, trainer):
                window.end = len(caught)

            def on_step_end(self, trainer, metrics):
                window.steps.append({"loop": window.end - window.start, "step": len(caught) - window.before,
                                     "loss": metrics["loss"], "where": [f"{Path(w.filename).name}:{w.lineno}"
                                                                        for w in caught[window.start:window.end]]})
                window.start, window.before = None, len(caught)

        self.callback, self.steps = Hook(), []
        self.start: Optional[int] = None
        self.end = self.before = 0


def _train_syncs(dtype: str, out: Path) -> tuple[bool, str, str]:
    cfg = _tiny(dtype, "data.total_steps=4")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        window = SyncWindow(caught)
        trainer = _trainer(cfg, out / f"train_{dtype[6:]}", [window.callback])
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    steady = window.steps[1:]  # the first step initializes libraries (cuBLAS handles, the allocator)
    loop = sum(s["loop"] for s in steady)
    finite = all(math.isfinite(s["loss"]) for s in window.steps)
    where = sorted({w for s in steady for w in s["where"]})[:3]
    ok = loop == 0 and finite and len(window.steps) == 4 and trainer.kernels is not None
    return ok, f"{loop} host syncs in the micro-batch loops of steps 2-4", \
        (f"{trainer.kernels.attention} attention, {trainer.kernels.cross_entropy} loss, micro_num 2; per step "
         f"{[s['step'] for s in window.steps]} syncs in all (clip, loss, metrics, timers)"
         + (f"; in the loop at {', '.join(where)}" if where else "") + ("" if finite else "; NON-FINITE loss"))


def row_train_bf16(out: Path):
    return _train_syncs("torch.bfloat16", out)


def row_train_fp16(out: Path):
    return _train_syncs("torch.float16", out)


def row_train_fp32(out: Path):
    return _train_syncs("torch.float32", out)


def row_async_resume(out: Path):
    """Two steps with an async checkpoint (staged into one pinned host buffer), then a new trainer resumes from it:
    the weights are bitwise those saved, and it trains on."""
    ckpt = out / "resume_ckpt"
    common = ("ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder={ckpt}", "ckpt.checkpoint_every=2",
              "ckpt.async_upload=True", "ckpt.auto_resume=True", "ckpt.lease_timeout=0")
    from internlm_core.callbacks import TrainerCallback
    staging: list[str] = []

    class SeeStaging(TrainerCallback):  # on_save: the save of this step is staged
        manager = None  # the run's checkpoint manager, set once the trainer is built

        def on_save(self, view, step, path):
            stager = getattr(getattr(self.manager, "_writer", None), "_stager", None)
            if stager is not None and stager.buffer is not None:
                staging.append(f"staging buffer {stager.buffer.numel() / 2**20:.1f} MiB, {stager.allocations} "
                               f"allocation(s), pinned {stager.pinned}")

    see = SeeStaging()
    first = _trainer(_tiny("torch.bfloat16", "data.total_steps=2", *common), out / "resume_a", [see])
    see.manager = first.checkpoint_manager
    first.train()
    first.checkpoint_manager.wait()
    saved = {n: p.detach().cpu().clone() for n, p in first.model.named_parameters()}
    first.checkpoint_manager.close()
    del first
    second = _trainer(_tiny("torch.bfloat16", "data.total_steps=3", *common), out / "resume_b")
    resumed_at = second.state.batch_count
    same = all(torch.equal(p.detach().cpu(), saved[n]) for n, p in second.model.named_parameters())
    second.train()
    second.checkpoint_manager.close()
    ok = resumed_at == 2 and same and second.state.batch_count == 3 and bool(staging)
    return ok, f"resumed at step {resumed_at}, weights {'bitwise equal' if same else 'DIFFER'}", \
        (staging[-1] if staging else "no async save was staged")


# ---- memory: the allocator against the estimator -------------------------------------------------------------------

def row_memory(out: Path):
    """configs/bench_gpu.py (1.1B, bf16) for 3 steps on one GPU: the CUDA allocator's peak (allocated, reserved)
    beside estimate(device="cuda") with the kernels the run chose; within 25% or a FAIL to look into."""
    from internlm_core.estimate import GiB, estimate
    from internlm_core.config import load_config
    cfg = load_config(str(ROOT / "configs/bench_gpu.py"), ["data.total_steps=3", "monitor.memory_report=True"])
    torch.cuda.reset_peak_memory_stats(CUDA)
    trainer = _trainer(cfg, out / "memory")
    trainer.train()
    report = json.loads((out / "memory" / "memory_report.json").read_text())["peak"]
    est = estimate(cfg, 1, device="cuda", attention=trainer.kernels.attention)
    allocated, reserved = report["peak_bytes"], report.get("peak_reserved_bytes", 0)
    ratio = allocated / est.memory.total
    return 0.75 <= ratio <= 1.25, (f"peak allocated {allocated / GiB:.2f} GiB, reserved {reserved / GiB:.2f} GiB; "
                                   f"estimate {est.memory.total / GiB:.2f} GiB (allocated / estimate {ratio:.2f})"), \
        f"{trainer.kernels.attention} attention, {trainer.kernels.cross_entropy} loss (the estimator's: " \
        f"{est.attention}/{est.cross_entropy}); outside the peak: CUDA context and NCCL"


def row_simulate_7b(out: Path):
    """`train.py --simulate 8 --simulate-device cuda` of configs/7B.py: rank 0's real shards, activations and
    optimizer step on this GPU (fake peers); its peak beside the estimator's, within 25%."""
    run_dir = out / "simulate_7b"
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/7B.py"), "--simulate", "8",
           "--simulate-device", "cuda", "--run-dir", str(run_dir), "--set", "data.total_steps=2"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170)
    (out / "simulate_7b.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        return False, f"exit status {p.returncode}", (p.stderr.strip().splitlines() or ["(no output)"])[-1][:200]
    s = json.loads((run_dir / "simulate.json").read_text())
    ratio = s["peak_over_estimate"]
    gib = 2**30
    return 0.75 <= ratio <= 1.25, (f"peak {s['peak_bytes'] / gib:.2f} GiB (reserved "
                                   f"{(s.get('peak_reserved_bytes') or 0) / gib:.2f}), estimate "
                                   f"{s['estimated_bytes'] / gib:.2f} GiB, ratio {ratio:.2f}"), \
        f"{s['layout']}, {s['attention']} attention, {s['cross_entropy']} loss, {s['steps']} steps"


ROWS = [
    Row("flash-attn attention vs sdpa (packed, GQA)", row_flash_attention, 30, when="flash_attn"),
    Row("flash-attn cross entropy bf16/fp16", row_flash_cross_entropy, 30, when="flash_attn"),
    Row("apex FusedAdam (step, zero_grad, resume)", row_apex, 20, when="apex"),
    Row("device and torch version", row_environment, 5),
    Row("torch names the code uses, in this torch", row_torch_api, 40),
    Row("init on the GPU equals the CPU (4096x4096)", row_init, 20),
    Row("NCCL: a non-last stage's step collectives", row_nccl_stage, 30),
    Row("trainer bf16, micro_num 2, sync debug", row_train_bf16, 45),
    Row("trainer fp16, micro_num 2, sync debug", row_train_fp16, 45),
    Row("trainer fp32, micro_num 2, sync debug", row_train_fp32, 45),
    Row("async save + resume on CUDA", row_async_resume, 60),
    Row("peak memory vs estimate (1.1B, 1 GPU)", row_memory, 90),
    Row("speed 1.1B eager: measured vs predicted", row_speed_eager, 60),
    Row("speed 1.1B compiled: measured vs predicted", row_speed_compiled, 150),
    Row("simulate 7B rank 0 of 8 on the GPU", row_simulate_7b, 170),
    Row("activation offload: peak and step time", row_offload, 40),
    Row("kernel choice, sdpa vs blocked attention", row_kernels, 20),
    Row("loss kernels bf16/fp16 vs fp32", row_loss_kernels, 30),
    Row("context attention, fp32 q/k + bf16 v", row_context_mixed_dtypes, 20),
    Row("MoE micro-batch, grouped GEMM, sync debug", row_moe_grouped_sync, 20),
    Row("norm output dtype under CUDA autocast", row_norm_autocast, 30),
    Row("torch API scan test (pytest -q)", row_torch_api_test, 60),
    Row("varlen kernel vs CPU contract", row_varlen_contract, 30),
    Row("model.fp8 tensorwise vs bf16 tokens/s", row_fp8_speed, 40),
    Row("fused head vs unfused: peak, syncs, grads", row_fused_head, 30),
]
