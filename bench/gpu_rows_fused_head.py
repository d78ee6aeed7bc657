"""The GPU check's row for model.fused_head_loss (bench/gpu_rows.py lists it in ROWS): Qwen's vocabulary (151,936)
at hidden 4096 and 8,192 tokens in bf16, the output layer and its loss once unfused (F.linear, then the loss kernel
numerics.select_cross_entropy picks on this GPU) and once fused (fused_head.py): the allocator's peak above the
inputs, the time of forward + backward, the host syncs of the fused one under torch.cuda.set_sync_debug_mode("warn")
(none expected: the label's gradient is a scatter, not an index of the hits) and its gradients against the unfused
ones. Passes when the fused peak is lower by at least half the bf16 logits (2.3 GiB), nothing synchronizes and
each gradient is within 2% of the unfused one's max; the times are reported, not judged (one more head matmul)."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

CUDA = torch.device("cuda", 0)
TOKENS, HIDDEN, VOCAB = 8192, 4096, 151936


def _run(fused: bool, x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, kernel: str):
    """(peak bytes above the inputs, seconds, dx, dw) of one forward + backward."""
    from internlm_core.fused_head import fused_head_cross_entropy
    from internlm_core.loss import FlashGPTLMLoss
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    if fused:
        loss = fused_head_cross_entropy(x, w, labels)[0].sum() / TOKENS
    else:
        loss, _ = FlashGPTLMLoss(kernel)(F.linear(x, w), labels)
    loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, time.perf_counter() - t0, x.grad, w.grad


def row_fused_head(out: Path):
    from internlm_core.numerics.kernels import select_cross_entropy
    from internlm_core.utils.accelerators import probe_flash_cross_entropy
    kernel = select_cross_entropy("cuda", 0.0, False, False, probe_flash_cross_entropy("cuda"), [], {})
    g = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(CUDA, torch.bfloat16)
    w = (0.02 * torch.randn(VOCAB, HIDDEN, generator=g)).to(CUDA, torch.bfloat16)
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=g).to(CUDA)
    _run(True, x, w, labels, kernel)  # warm-up: cuBLAS handles, the allocator
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            peak_f, t_f, dx_f, dw_f = _run(True, x, w, labels, kernel)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    peak_u, t_u, dx_u, dw_u = _run(False, x, w, labels, kernel)
    errors = {n: float((a.float() - b.float()).abs().max() / b.float().abs().max())
              for n, a, b in (("dx", dx_f, dx_u), ("dw", dw_f, dw_u))}
    logits = 2 * TOKENS * VOCAB
    where = sorted({f"{Path(c.filename).name}:{c.lineno}" for c in caught})
    ok = peak_u - peak_f > logits / 2 and not caught and max(errors.values()) < 0.02
    return ok, (f"peak above inputs: fused {peak_f / 2**30:.2f} GiB, unfused ({kernel}) {peak_u / 2**30:.2f} GiB; "
                f"time {t_f * 1e3:.0f} ms vs {t_u * 1e3:.0f} ms"), \
        (f"gradients vs unfused: dx {errors['dx']:.2%}, dw {errors['dw']:.2%} of max; host syncs in the fused "
         f"one: {len(caught)} at {', '.join(where) or 'none'}; {TOKENS} tokens, hidden {HIDDEN}, vocab {VOCAB}")
