"""The GPU check's numerics rows and the tolerance they share (bench/gpu_rows.py lists them in ROWS).

A 16-bit kernel is compared per tensor with an fp32 reference, never with one tolerance for all: an attention's dV is
about five times larger than its output (it sums the weights of every query a key served), so two correct bf16
kernels differ in dV by more than 2% of the output's max (0.125 against 0.059 on the case the unit test measures).
`tensor_errors` gives each tensor its own allowance: the larger of TOL_REL of that tensor's own max and TOL_FACTOR
times the error a 16-bit reference implementation makes against the same fp32 reference. A real defect (a wrong
mask, a lost document boundary, a dropped gradient term) is off by the size of the values themselves, 50x above.

Rows here: the context-parallel kernels with fp32 q/k and a bf16 v (what Qwen3's q/k norms handed on under CUDA
autocast), one MoE micro-batch through the grouped GEMM under torch.cuda.set_sync_debug_mode, the norms' output
dtype under CUDA autocast, and the torch API scan test (tests/unit/test_torch_api*.py) run with pytest.
"""

from __future__ import annotations

import contextlib
import copy
import math
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Iterator, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.device("cuda", 0)
NAMES = ("out", "dq", "dk", "dv")
# the allowance of a 16-bit tensor against its fp32 reference: TOL_REL of the tensor's own largest magnitude, or
# TOL_FACTOR x what a 16-bit reference implementation's own rounding costs against the same reference, whichever is
# larger (both sit 10-50x below what a wrong mask or a lost gradient term costs)
TOL_REL = 0.02
TOL_FACTOR = 4.0


def tensor_errors(got: dict[str, torch.Tensor], ref32: dict[str, torch.Tensor],
                  ref16: Optional[dict[str, torch.Tensor]] = None, rel: float = TOL_REL,
                  factor: float = TOL_FACTOR) -> tuple[bool, dict[str, tuple[float, float]]]:
    """(every tensor within its allowance, {name: (max |got - ref32|, allowance)}) for the tensors of `ref32`; the
    allowance is max(rel x max |ref32[name]|, factor x max |ref16[name] - ref32[name]|) (ref16 None: the first
    term only). A non-finite error fails."""
    report, ok = {}, True
    for name, ref in ref32.items():
        ref = ref.float()
        err = (got[name].float() - ref).abs().max().item()
        allowed = rel * ref.abs().max().item()
        if ref16 is not None:
            allowed = max(allowed, factor * (ref16[name].float() - ref).abs().max().item())
        report[name] = (err, allowed)
        ok = ok and math.isfinite(err) and err <= allowed
    return ok, report


def format_errors(report: dict[str, tuple[float, float]]) -> str:
    """'out 8.1e-03 <= 5.9e-02, ...': each tensor's error and allowance."""
    return ", ".join(f"{name} {err:.1e} {'<=' if err <= allowed else 'OVER'} {allowed:.1e}"
                     for name, (err, allowed) in report.items())


def packed_batch(device: torch.device, T: int = 2048, rows: tuple[tuple[int, ...], ...] = ((37, 900, 1, 611, 499),
                                                                                           (1024, 1024)),
                 H: int = 32, Hkv: int = 4, D: int = 64, seed: int = 0):
    """cu_seqlens of documents `rows` (each row's lengths sum to T), bf16-valued q [B, T, H, D], k/v [B, T, Hkv, D]
    (fp32 copies of bf16 values) and an fp32 output weight w, on `device`."""
    g = torch.Generator().manual_seed(seed)
    lengths = [n for row in rows for n in row]
    if any(sum(row) != T for row in rows):
        raise ValueError(f"packed_batch: every row's document lengths must sum to T={T}, got {rows}")
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    B = len(rows)
    q, k, v = (torch.randn(B, T, h, D, generator=g).to(torch.bfloat16).float().to(device) for h in (H, Hkv, Hkv))
    return cu, q, k, v, torch.randn(B, T, H, D, generator=g).to(device)


def attention_tensors(backend: str, cu: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      w: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """{out, dq, dk, dv} (fp32 copies) of the package's `attention` with `backend` on q, k, v in `dtype`, the
    gradients those of sum(out * w)."""
    from internlm_core.model.attention import attention, build_packed_meta
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    B, T = q.shape[:2]
    out = attention(q, k, v, build_packed_meta(cu, B, T, backend, q.device), backend)
    grads = torch.autograd.grad((out * w.to(dtype)).sum(), (q, k, v))
    return {name: t.detach().float() for name, t in zip(NAMES, (out, *grads))}


def compare_attention(backend: str, reference: str, device: torch.device, **batch) -> tuple[bool, str, str]:
    """`backend` in bf16 against `reference` in fp32 on one packed batch (mixed document lengths, grouped-query
    heads), each tensor within its own allowance (`tensor_errors`, `reference` in bf16 as the 16-bit reference)."""
    cu, q, k, v, w = packed_batch(device, **batch)
    ref32 = attention_tensors(reference, cu, q, k, v, w, torch.float32)
    ref16 = attention_tensors(reference, cu, q, k, v, w, torch.bfloat16)
    got = attention_tensors(backend, cu, q, k, v, w, torch.bfloat16)
    ok, report = tensor_errors(got, ref32, ref16)
    return ok, format_errors(report), f"{backend} bf16 vs {reference} fp32 (allowance: {TOL_REL:.0%} of each " \
                                      f"tensor's max or {TOL_FACTOR:g}x {reference} bf16's own error)"


@contextlib.contextmanager
def _one_rank_nccl() -> Iterator[None]:
    import torch.distributed as dist
    torch.cuda.set_device(CUDA)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=CUDA)
    try:
        yield
    finally:
        dist.destroy_process_group()


def row_context_mixed_dtypes(out: Path) -> tuple[bool, str, str]:
    """The context-parallel attention (one rank: C = 1, its one-rank NCCL all-to-all and the blockwise core with its
    hand-written backward) fed fp32 q/k and a bf16 v, with and without bf16 autocast: it runs, returns bf16, hands
    q/k their gradients in fp32, and every tensor is within its allowance of sdpa in fp32."""
    from internlm_core.model.context import ContextGroup, build_context_meta, context_attention
    lengths = ((37, 900, 1, 611, 499), (1024, 1024))
    cu, q, k, v, w = packed_batch(CUDA, rows=lengths)
    B, T = q.shape[:2]
    doc = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in lengths], device=CUDA)
    ref32 = attention_tensors("sdpa", cu, q, k, v, w, torch.float32)
    ref16 = attention_tensors("sdpa", cu, q, k, v, w, torch.bfloat16)
    results, ok = [], True
    with _one_rank_nccl():
        meta = build_context_meta(ContextGroup(None, 1, 0, "ring"), doc, B, T, CUDA)
        for autocast in (False, True):
            qf, kf = (t.detach().clone().requires_grad_() for t in (q, k))
            vb = v.detach().to(torch.bfloat16).requires_grad_()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                o = context_attention(qf, kf, vb, meta)
            grads = torch.autograd.grad((o.float() * w).sum(), (qf, kf, vb))
            dtypes = [str(t.dtype)[6:] for t in (o, *grads)]
            good = dtypes == ["bfloat16", "float32", "float32", "bfloat16"]
            close, report = tensor_errors(dict(zip(NAMES, (o, *grads))), ref32, ref16)
            ok = ok and good and close
            results.append(f"autocast {'on' if autocast else 'off'}: {format_errors(report)}"
                           + ("" if good else f"; dtypes out/dq/dk/dv {dtypes}"))
    return ok, "; ".join(results), "fp32 q/k + bf16 v through context_attention (C = 1) vs sdpa fp32"


def _moe_layer(gemm: str):
    from internlm_core.model.moe import MoEArgs, MoEFeedForward
    torch.manual_seed(0)
    args = MoEArgs(num_experts=8, top_k=2, ffn_width=1024, moe_type="Dropless", expert_gemm=gemm)
    return MoEFeedForward(512, args).to(CUDA)


def _moe_micro_batch(layer, x: torch.Tensor, w: torch.Tensor, caught: list) -> tuple[dict, int, int]:
    """One micro-batch as the trainer runs it (forward under bf16 autocast, backward outside): {y, dx, dw1, dw3,
    dw2} and the host syncs of the forward and of the backward."""
    x = x.detach().clone().requires_grad_()
    start = len(caught)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    mid = len(caught)
    params = (layer.experts.w1, layer.experts.w3, layer.experts.w2)
    grads = torch.autograd.grad((y.float() * w).sum(), (x, *params))
    tensors = dict(zip(("y", "dx", "dw1", "dw3", "dw2"), (y, *grads)))
    return {n: t.detach().float() for n, t in tensors.items()}, mid - start, len(caught) - mid


def row_moe_grouped_sync(out: Path) -> tuple[bool, str, str]:
    """One MoE micro-batch (8 experts, top 2, 4096 tokens) with torch's grouped GEMM under
    torch.cuda.set_sync_debug_mode("warn"): the grouped GEMM runs on this GPU and torch, its output and gradients
    are within 2% of each tensor's max of the per-expert loop's (same routing: the same gate and inputs), and the
    host syncs of the micro-batch are counted where they happen (the routing's expert counts go to the host: the
    expert GEMMs need them; reported, not failed)."""
    from internlm_core.model.moe import grouped_mm_available
    if not grouped_mm_available(CUDA, torch.bfloat16):
        return False, f"torch {torch.__version__}'s grouped GEMM does not run for bf16 on this GPU", \
            "moe.expert_gemm=auto would loop per expert here"
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 2048, 512, generator=g).to(CUDA), torch.randn(2, 2048, 512, generator=g).to(CUDA)
    grouped = _moe_layer("grouped")
    loop = copy.deepcopy(grouped)
    loop.experts.gemm = "loop"
    _moe_micro_batch(grouped, x, w, [])  # warm-up: the grouped GEMM's probe, cuBLAS handles, the allocator
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            got, fwd, bwd = _moe_micro_batch(grouped, x, w, caught)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    where = sorted({f"{Path(c.filename).name}:{c.lineno}" for c in caught})
    ref, _, _ = _moe_micro_batch(loop, x, w, [])
    ok, report = tensor_errors(got, ref)
    return ok, f"grouped vs loop: {format_errors(report)}", \
        f"host syncs: {fwd} in the forward, {bwd} in the backward, at {', '.join(where) or 'none'}"


def row_norm_autocast(out: Path) -> tuple[bool, str, str]:
    """Under bf16 autocast on CUDA torch's own rms_norm returns fp32 (CUDA's autocast rule); the package's norms
    return their input's dtype (model/layers.RMSNorm), both the plain and the use_fp32_norm kind, and every norm of
    a Qwen3-style model (q/k norms) hands bf16 on in a real training step."""
    import torch.nn.functional as F

    from internlm_core.model.layers import RMSNorm
    from gpu_rows import _tiny, _trainer
    x = torch.randn(8, 256, device=CUDA, dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        raw = F.rms_norm(x, (256,), torch.ones(256, device=CUDA), 1e-6).dtype
        ours = [RMSNorm(256, 1e-6, fp32=fp32).to(CUDA)(x).dtype for fp32 in (False, True)]
    seen: dict[str, set] = {}

    def hook(name):
        return lambda module, args, output: seen.setdefault(str(output.dtype)[6:], set()).add(name)

    trainer = _trainer(_tiny("torch.bfloat16", "data.total_steps=1", "model.qk_norm=True"), out / "norm_autocast")
    norms = [(n, m) for n, m in trainer.model.named_modules() if isinstance(m, (torch.nn.RMSNorm, torch.nn.LayerNorm))]
    for name, module in norms:
        module.register_forward_hook(hook(name))
    trainer.train()
    ok = ours == [torch.bfloat16, torch.bfloat16] and set(seen) == {"bfloat16"} and len(norms) > 0
    return ok, f"RMSNorm {str(ours[0])[6:]}, fp32 kind {str(ours[1])[6:]}; {len(norms)} norms of a qk_norm model " \
               f"returned {sorted(seen)}", f"torch's own rms_norm under CUDA autocast: {str(raw)[6:]}"


def row_torch_api_test(out: Path) -> tuple[bool, str, str]:
    """tests/unit/test_torch_api*.py (the scan of every torch name the code uses against the supported versions'
    sources) with pytest -q, on this machine's Python."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests/unit").glob("test_torch_api*.py"))
    if not files:
        return False, "no tests/unit/test_torch_api*.py in this checkout", ""
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    (out / "torch_api_test.log").write_text(p.stdout + p.stderr)
    last = (p.stdout.strip().splitlines() or ["(no output)"])[-1]
    return p.returncode == 0, last[:200], " ".join(files)
