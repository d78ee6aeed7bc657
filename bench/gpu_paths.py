#!/usr/bin/env python
"""Every GPU path once, checked and timed (run by tools/gpu_check.sh; on a CPU machine the CUDA-only rows say so).

    python bench/gpu_paths.py --json OUT/paths.json [--apex]     # the kernel checks, a table, and the rows as JSON
    python bench/gpu_paths.py --table OUT                          # one table: OUT/paths.json + the training runs

Rows: which accelerators import AND run (utils.accelerators), what numerics.select_kernels chooses for bf16 and
fp32; attention on one packed batch (documents of mixed length, grouped-query heads) by flash-attn's varlen
kernel, SDPA with the dense document mask and the blocked CPU kernel, against each other (outputs, gradients,
time, peak memory); SDPA's grouped-query + mask path with k/v repeated vs `enable_gqa`; fp32 inputs through the
flash path (cast to bf16); every cross-entropy kernel under bf16 / fp16 with a 2**16 loss scale against fp32
(entries lost, worst relative error, time, peak memory); host synchronizations in one packed micro-batch of a
small model (torch.cuda sync debug mode); apex FusedAdam (step and zero_grad as the trainer calls it), only when
asked. The training rows (bf16 MFU of configs/bench_gpu.py, a 2-GPU FSDP step) come from gpu_check.sh's runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROWS: list[dict] = []
# the packed attention batch: 2 rows of T tokens, documents of mixed length (one of a single token), 32 query heads
# over 4 key/value heads; --quick shrinks it (and the loss) for a smoke run on a CPU
SIZE = {"T": 2048, "lengths": [37, 900, 1, 611, 499, 1024, 1024]}
QUICK = {"T": 256, "lengths": [37, 100, 1, 60, 58, 128, 128]}


def row(check: str, ok: bool | None, result: str, detail: str = "") -> None:
    ROWS.append({"check": check, "ok": ok, "result": result, "detail": detail})
    mark = {True: "ok", False: "FAIL", None: "--"}[ok]
    print(f"{mark:4} {check:<38} {result}  {detail}", flush=True)


def timed(fn, device: torch.device, reps: int = 5) -> tuple[float, int]:
    """(median ms, peak bytes above the start) of fn() on `device` (CPU: wall time, no memory figure)."""
    fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    return statistics.median(times), peak


def check_environment(device: torch.device) -> None:
    from internlm_core.utils import accelerators as acc
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (no CUDA device)"
    row("device", device.type == "cuda" or None, name, f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    for label, probe in (("flash-attn attention", acc.probe_flash_attn), ("flash-attn cross entropy",
                                                                            acc.probe_flash_cross_entropy),
                         ("NVIDIA apex FusedAdam", acc.probe_apex)):
        p = probe(device.type)
        row(label, p.ok if p.installed else None, "works" if p.ok else p.why_not())


def check_kernel_choice(device: torch.device) -> None:
    from internlm_core.config import load_config
    from internlm_core.numerics import resolve_precision, select_kernels
    cfg = load_config(str(ROOT / "configs" / "bench_gpu.py"))
    for dtype in ("torch.bfloat16", "torch.float32"):
        k = select_kernels(cfg.model, cfg.adam, resolve_precision(dtype, device), device, log=False)
        fp32_not_on_flash = dtype != "torch.float32" or k.attention != "flash"
        row(f"select_kernels {dtype.split('.')[1]}", fp32_not_on_flash,
            f"{k.attention} / {k.cross_entropy} / {k.linear} / {k.optimizer}", "; ".join(k.notes + k.warnings))


def packed_batch(device: torch.device, dtype: torch.dtype, B=2, H=32, Hkv=4, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, lengths = SIZE["T"], SIZE["lengths"]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    assert int(cu[-1]) == B * T
    q, k, v = (torch.randn(B, T, h, D, generator=g).to(device, dtype).requires_grad_() for h in (H, Hkv, Hkv))
    return cu, q, k, v, torch.randn(B, T, H, D, generator=g).to(device, dtype)


def check_attention(device: torch.device) -> None:
    from internlm_core.model.attention import attention, build_packed_meta
    from internlm_core.utils.accelerators import probe_flash_attn
    cu, q, k, v, w = packed_batch(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    B, T = q.shape[:2]
    backends = ["sdpa", "cpu_blocked"] + (["flash"] if probe_flash_attn(device.type).ok else [])
    results = {}
    for backend in backends:
        meta = build_packed_meta(cu, B, T, backend, device)

        def step():
            out = attention(q, k, v, meta, backend)
            grads = torch.autograd.grad((out * w).sum(), (q, k, v))
            return out, grads
        out, grads = step()
        ms, peak = timed(lambda: step(), device)
        results[backend] = (out.float(), [g.float() for g in grads])
        row(f"attention {backend}", True, f"{ms:.2f} ms fwd+bwd", f"peak {peak / 2**20:.0f} MiB" if peak else "")
    ref_out, ref_grads = results["sdpa"]
    for backend in backends[1:]:
        out, grads = results[backend]
        diff = max([(out - ref_out).abs().max().item()] + [(a - b).abs().max().item() for a, b in zip(grads, ref_grads)])
        scale = ref_out.abs().max().item()
        row(f"attention {backend} vs sdpa (packed)", diff <= 0.02 * max(scale, 1.0), f"max diff {diff:.2e}",
            "same packed batch, outputs and q/k/v gradients")
    if "flash" not in backends:
        row("attention flash vs sdpa (packed)", None, "skipped", "flash-attn not working here")


def check_gqa_mask_memory(device: torch.device) -> None:
    """SDPA with a document mask and 4x fewer k/v heads: our path (k/v repeated on CUDA) against enable_gqa."""
    from internlm_core.model.attention import _causal_document_mask, document_ids_from_cu_seqlens, sdpa_attention
    cu, q, k, v, w = packed_batch(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    mask = _causal_document_mask(document_ids_from_cu_seqlens(cu, 2, q.shape[1]).to(device))
    qt, kt, vt, wt = (t.transpose(1, 2) for t in (q, k, v, w))
    ours = timed(lambda: torch.autograd.grad((sdpa_attention(qt, kt, vt, mask) * wt).sum(), (q, k, v)), device)
    gqa = timed(lambda: torch.autograd.grad((F.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=mask, enable_gqa=True) * wt).sum(), (q, k, v)), device)
    probs = q.shape[0] * q.shape[2] * q.shape[1] ** 2 * 4
    if device.type == "cuda":
        row("sdpa GQA + document mask", ours[1] < probs, f"{ours[0]:.2f} ms, peak {ours[1] / 2**20:.0f} MiB",
            f"enable_gqa: {gqa[0]:.2f} ms, peak {gqa[1] / 2**20:.0f} MiB; fp32 probabilities {probs / 2**20:.0f} MiB")
    else:
        row("sdpa GQA + document mask", None, f"{ours[0]:.1f} ms (CPU)", "memory is shown on CPU by "
            "tests/unit/test_attention_memory.py")


def check_flash_fp32(device: torch.device) -> None:
    from internlm_core.model.attention import attention, build_packed_meta
    from internlm_core.utils.accelerators import probe_flash_attn
    if not probe_flash_attn(device.type).ok:
        row("flash path with fp32 inputs", None, "skipped", "flash-attn not working here")
        return
    cu, q, k, v, _ = packed_batch(device, torch.float32)
    B, T = q.shape[:2]
    out = attention(q, k, v, build_packed_meta(cu, B, T, "flash", device), "flash")
    ref = attention(q, k, v, build_packed_meta(cu, B, T, "sdpa", device), "sdpa")
    diff = (out - ref).abs().max().item()
    row("flash path with fp32 inputs", out.dtype == torch.float32 and diff < 0.05, f"max diff {diff:.2e} vs fp32 sdpa",
        "q/k/v cast to bf16 for the kernel")


def check_losses(device: torch.device, n: int, v: int) -> None:
    from internlm_core.loss import FlashGPTLMLoss
    from internlm_core.utils.accelerators import probe_flash_cross_entropy
    kernels = ["fused_chunked", "torch"] + (["flash"] if probe_flash_cross_entropy(device.type).ok else [])
    g = torch.Generator().manual_seed(0)
    base = 2 * torch.randn(n, v, generator=g)
    y = torch.randint(0, v, (n,), generator=g)
    y[::9] = -100
    y = y.to(device)
    scale = 2.0**16 / 4
    for dtype in (torch.bfloat16, torch.float16):
        x16 = base.to(device, dtype)
        xr = x16.float().requires_grad_()
        (F.cross_entropy(xr, y, ignore_index=-100) * scale).backward()
        ref = xr.grad
        fi = torch.finfo(dtype)
        holds = ref.abs() >= fi.tiny * fi.eps
        normal = ref.abs() >= fi.tiny
        for kernel in kernels:
            fn = FlashGPTLMLoss(kernel)

            def step():
                x = x16.clone().requires_grad_()
                loss, _ = fn(x * 1, y)  # x * 1: flash's in-place backward writes into a non-leaf
                (loss * scale).backward()
                return x.grad
            got = step().float()
            lost = int(((got == 0) & holds).sum())
            rel = ((got - ref).abs() / ref.abs())[normal].max().item()
            ms, peak = timed(step, device, reps=3)
            ok = lost == 0 and rel <= 2.5 * fi.eps
            row(f"loss {kernel} {str(dtype).split('.')[1]}", ok, f"{lost} entries lost, worst rel {rel:.1e}",
                f"{ms:.1f} ms fwd+bwd" + (f", peak {peak / 2**20:.0f} MiB" if peak else "") + f" ({n}x{v})")


def check_syncs(device: torch.device) -> None:
    """Host synchronizations in one packed micro-batch (forward, loss, backward) of a small model."""
    if device.type != "cuda":
        row("host syncs per micro-batch", None, "skipped", "CUDA only")
        return
    from internlm_core.config import load_config
    from internlm_core.loss import FlashGPTLMLoss
    from internlm_core.model import build_model
    from internlm_core.numerics import resolve_precision, select_kernels
    from internlm_core.utils.transfer import to_device
    cfg = load_config(str(ROOT / "configs" / "bench_gpu.py"), ["model.num_layers=2", "model.hidden_size=512",
                                                               "model.num_attention_heads=8",
                                                               f"data.seq_len={SIZE['T']}"])
    precision = resolve_precision(cfg.model.dtype, device)
    k = select_kernels(cfg.model, cfg.adam, precision, device, log=False)
    model = build_model(cfg, device, attn_backend=k.attention)
    loss_fn = FlashGPTLMLoss(k.cross_entropy)
    cu, *_ = packed_batch(torch.device("cpu"), torch.float32)
    ids = torch.randint(0, cfg.model.vocab_size, (2, SIZE["T"]))

    def step():
        x = to_device(ids, device)
        with precision.autocast():
            loss, _ = loss_fn(model(x, None, cu), x)
        loss.backward()
    step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0][:80] for w in caught if "synchroniz" in str(w.message)]
    row("host syncs per micro-batch", len(syncs) == 0, f"{len(syncs)} synchronizations",
        f"{k.attention} attention, {k.cross_entropy} loss" + (f"; first: {syncs[0]}" if syncs else ""))


def check_apex(device: torch.device, asked: bool) -> None:
    if not asked:
        row("apex FusedAdam", None, "not asked", "APEX=1 bash tools/gpu_check.sh runs it")
        return
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    from internlm_core.config.schema import AdamConfig
    from internlm_core.optim import build_optimizer
    model = torch.nn.Linear(256, 256).to(device)
    opt = build_optimizer(model, AdamConfig(), "apex")
    _init_optim_state(opt)
    model(torch.randn(4, 256, device=device)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    row("apex FusedAdam", all(p.grad is None for p in model.parameters()), "step + zero_grad(set_to_none=True)",
        "and DCP's optimizer-state initialization (resume)")


def table(out: Path) -> int:
    """One table: the kernel rows and the training runs gpu_check.sh left in `out`."""
    rows = json.loads((out / "paths.json").read_text()) if (out / "paths.json").exists() else []
    for name, label in (("train1", "train bench_gpu 1.1B bf16, 1 GPU"), ("fsdp2", "train FSDP, 2 GPUs")):
        metrics = out / name / "metrics.jsonl"
        if not metrics.exists():
            rows.append({"check": label, "ok": None, "result": "not run", "detail": ""})
            continue
        recs = [json.loads(line) for line in metrics.read_text().splitlines()]
        train = [r for r in recs if r.get("kind") == "train"]
        timed_steps = [r for r in train if r["step"] > 5] or train
        tgs = statistics.median(r["tgs"] for r in timed_steps)
        mfu = statistics.median(r["mfu"] for r in timed_steps if r.get("mfu") is not None) if any(
            r.get("mfu") is not None for r in timed_steps) else None
        report = out / name / "memory_report.json"
        peak = json.loads(report.read_text())["peak"]["peak_bytes"] / 2**30 if report.exists() else None
        ok = bool(train) and all(r["loss"] == r["loss"] for r in train)
        rows.append({"check": label, "ok": ok, "result": f"{tgs:,.0f} tokens/s/GPU"
                     + (f", MFU {mfu:.1%}" if mfu is not None else ""),
                     "detail": f"{len(train)} steps, final loss {train[-1]['loss']:.3f}"
                     + (f", peak {peak:.1f} GiB" if peak is not None else "")})
    print("\n| check | ok | result | detail |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['check']} | {dict([(True, 'ok'), (False, 'FAIL'), (None, '--')])[r['ok']]} | {r['result']} | "
              f"{r['detail']} |")
    return 1 if any(r["ok"] is False for r in rows) else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--table", type=Path, help="print the one table of a gpu_check.sh output folder and exit")
    p.add_argument("--apex", action="store_true", help="also run apex's FusedAdam")
    p.add_argument("--loss-size", default="16384x32000", help="tokens x vocabulary of the loss checks")
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run on a CPU)")
    a = p.parse_args(argv)
    if a.table:
        return table(a.table)
    if a.quick:
        SIZE.update(QUICK)
        a.loss_size = "512x2000"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n, v = (int(x) for x in a.loss_size.split("x"))
    for check in (check_environment, check_kernel_choice, check_attention, check_gqa_mask_memory, check_flash_fp32,
                  lambda d: check_losses(d, n, v), check_syncs, lambda d: check_apex(d, a.apex)):
        try:
            check(device)
        except Exception as e:  # one broken path must not hide the others
            row(getattr(check, "__name__", "check").replace("check_", ""), False, f"{type(e).__name__}: {e}"[:160])
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(ROWS, indent=1))
    return 1 if any(r["ok"] is False for r in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
