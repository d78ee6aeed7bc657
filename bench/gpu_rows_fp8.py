"""The GPU check's row for model.fp8 (bench/gpu_rows.py lists it in ROWS): one GPU, a 1B-class stack of 8 blocks
(hidden 2048, FFN 5632, 2 x 4096 tokens, bf16 autocast over fp32 parameters, as one process trains), forward +
backward with the block linears in bf16 and in torchao's tensorwise float8 (parallel/float8.convert_to_fp8, the
trainer's converter): tokens/s of each, their ratio beside the estimator's predicted ratio (estimate/speed.py on an
H200: the converted GEMMs at twice the bf16 rate plus the casts), and the float8 output against bf16's. Passes when
both run, the float8 output is within 10% of bf16's (relative norm) and its gradients are finite; the speed is
reported, not judged (the prediction's efficiencies are what this row corrects)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

CUDA = torch.device("cuda", 0)
TOKENS = 2 * 4096


def _cfg(fp8: str = "off"):
    from internlm_core.config import build_config
    return build_config({"model_type": "INTERNLM", "data": {"seq_len": 4096, "micro_bsz": 2, "micro_num": 1},
                         "model": dict(num_layers=8, hidden_size=2048, num_attention_heads=16, vocab_size=32000,
                                       multiple_of=256, dtype="torch.bfloat16", use_flash_attn=False, fp8=fp8)})


def _measure(state: dict, fp8: bool, ids: torch.Tensor, steps: int = 4):
    from internlm_core.config.fp8 import fp8_plan
    from internlm_core.model import build_model, model_spec
    from internlm_core.parallel.float8 import convert_to_fp8
    cfg = _cfg()
    model = build_model(cfg)
    model.load_state_dict(state)
    if fp8:
        convert_to_fp8(model, model_spec(cfg.model_inputs()).plan.blocks(model), fp8_plan("tensorwise"), device=CUDA)
    model.to(CUDA)
    times, out = [], None
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", torch.bfloat16):
            out = model(ids)
            loss = out.float().pow(2).mean()
        loss.backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    finite = all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    result = out.detach().float().cpu()
    del model
    torch.cuda.empty_cache()
    return TOKENS / min(times[1:]), result, finite


def _predicted_ratio() -> float:
    from internlm_core.estimate import estimate
    from internlm_core.estimate.gpus import gpu_spec
    from internlm_core.estimate.speed import predict
    t = [predict(estimate(_cfg(f), 1, device="cuda", attention="sdpa"), gpu_spec("h200")).step_time
         for f in ("off", "tensorwise")]
    return t[0] / t[1]


def row_fp8_speed(out: Path):
    from internlm_core.model import build_model
    torch.manual_seed(0)
    state = build_model(_cfg()).state_dict()
    ids = torch.randint(0, 32000, (2, 4096), generator=torch.Generator().manual_seed(1)).to(CUDA)
    bf16_tps, ref, _ = _measure(state, False, ids)
    fp8_tps, got, finite = _measure(state, True, ids)
    rel = float((got - ref).norm() / ref.norm())
    ok = finite and rel < 0.1
    return ok, (f"bf16 {bf16_tps:,.0f} tokens/s, float8 tensorwise {fp8_tps:,.0f} tokens/s ({fp8_tps / bf16_tps:.2f}x; "
                f"predicted {_predicted_ratio():.2f}x)"), \
        f"output vs bf16 {rel:.2%}, gradients {'finite' if finite else 'NOT finite'}; 8 blocks, hidden 2048, 2 x 4096"
