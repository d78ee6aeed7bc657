"""The GPU check's row for model.offload_activations (bench/gpu_rows.py lists it in ROWS): one GPU, a 1B-class
stack of 8 blocks (hidden 2048, 4096 tokens per row, bf16 autocast), forward + backward with and without the offload:
the CUDA allocator's peak, the step time, and the gradients (bitwise equal: the same kernels on the same inputs;
the copies only move bytes). Passes when the gradients are equal and the peak drops by at least half of what
the blocks' saved tensors take without the offload (the estimator counts two blocks of eight left on the device)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

CUDA = torch.device("cuda", 0)


def _cfg():
    from internlm_core.config import build_config
    return build_config({"model_type": "INTERNLM", "data": {"seq_len": 4096, "micro_bsz": 2},
                         "model": dict(num_layers=8, hidden_size=2048, num_attention_heads=16, vocab_size=32000,
                                       multiple_of=256, dtype="fp32", use_flash_attn=False)})


def _measure(state: dict, offload: bool, ids: torch.Tensor, steps: int = 3):
    from internlm_core.model import build_model
    from internlm_core.parallel.offload import offload_blocks
    model = build_model(_cfg())
    model.load_state_dict(state)
    model.to(CUDA)
    offloader = offload_blocks(list(model.layers.values()), CUDA) if offload else None
    times = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(CUDA)
        base = torch.cuda.memory_allocated(CUDA)
        t0 = time.perf_counter()
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(ids).float().pow(2).mean()
        loss.backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated(CUDA) - base
    grads = [p.grad.detach().cpu() for p in model.parameters()]
    moved = offloader.stats.offloaded_bytes / steps if offloader else 0
    del model
    torch.cuda.empty_cache()
    return peak, min(times[1:]), grads, moved


def row_offload(out: Path):
    from internlm_core.model import build_model
    torch.manual_seed(0)
    state = build_model(_cfg()).state_dict()
    ids = torch.randint(0, 32000, (2, 4096), generator=torch.Generator().manual_seed(1)).to(CUDA)
    peak0, t0, g0, _ = _measure(state, False, ids)
    peak1, t1, g1, moved = _measure(state, True, ids)
    equal = all(torch.equal(a, b) for a, b in zip(g0, g1))
    gib = 2**30
    ok = equal and moved > 0 and peak0 - peak1 >= 0.5 * moved
    return ok, (f"peak {peak0 / gib:.2f} -> {peak1 / gib:.2f} GiB with offload ({moved / gib:.2f} GiB moved per "
                f"step), step {t0 * 1e3:.0f} -> {t1 * 1e3:.0f} ms"), \
        f"gradients {'bitwise equal' if equal else 'DIFFER'}; 8 blocks, hidden 2048, 2 x 4096 tokens, bf16 autocast"
