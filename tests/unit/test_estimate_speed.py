"""The speed prediction (estimate/speed.py): a tiny config checked term by term against hand-computed figures,
the directions the terms must move in, and the GPU table by name."""

import json

import pytest

from internlm_core.config import load_config
from internlm_core.errors import ConfigError
from internlm_core.estimate import estimate
from internlm_core.estimate.gpus import EFFICIENCY, GPUS, gpu_spec
from internlm_core.estimate.speed import SpeedKernels, default_attention, default_kernels, predict
from tests.helpers.launch import run_script


def _tiny(*sets, world=1):
    return load_config("configs/tiny.py", ["model.dtype='torch.bfloat16'", *sets], world_size=world)


def test_tiny_config_term_by_term():
    """INTERNLM, 2 layers, hidden 128, 4 heads, FFN 384, vocabulary 512, seq 256, 2 x 2 micro-batches, one H200
    with flash attention: every compute term from the shapes by hand."""
    cfg = _tiny()
    e = estimate(cfg, 1, device="cuda", attention="flash")
    assert e.model_args.ffn_width == 384
    gpu, eff = GPUS["h200"], EFFICIENCY["hopper"]
    peak, hbm = 989e12, 4800e9 * eff["hbm"]
    p = predict(e, gpu)
    tokens, layers = 2 * 256 * 2, 2
    block_fwd = 2 * (128 * 3 * 128 + 128 * 128 + 3 * 384 * 128)   # wqkv, wo, w1/w3/w2
    head_fwd = 2 * 512 * 128
    assert p.terms["GEMM"] == pytest.approx(3 * tokens * (layers * block_fwd + head_fwd) / (peak * eff["gemm"]))
    attn_fwd = 4 * 4 * 32 * 256 / 2   # 4 * heads * head_dim * seq, half of it under the causal kernel
    assert p.terms["attention"] == pytest.approx(tokens * layers * attn_fwd * (
        1 / (peak * eff["flash_fwd"]) + 2.5 / (peak * eff["flash_bwd"])))
    tb = e.token_bytes
    assert p.terms["memory-bound ops"] == pytest.approx(tokens * 4 * (layers * tb.block + tb.head + tb.shared) / hbm)
    assert p.terms["optimizer step"] == pytest.approx(32 * e.parameters / hbm)
    assert p.terms["recompute"] == 0 and p.terms["pipeline bubble"] == 0
    assert set(p.terms) == {"GEMM", "expert GEMM", "attention", "recompute", "memory-bound ops", "optimizer step",
                            "pipeline bubble"}   # one GPU: no communication at all
    assert p.step_time == pytest.approx(sum(p.terms.values()))
    assert p.mfu == pytest.approx(tokens * e.model_flops_per_token / p.step_time / peak)
    assert p.tokens_per_gpu_per_second == pytest.approx(tokens / p.step_time)


def test_recompute_and_bubble_and_compile():
    eff, peak = EFFICIENCY["hopper"], 989e12
    base = predict(estimate(_tiny(), 1, device="cuda", attention="flash"), GPUS["h200"])
    ckpt = predict(estimate(_tiny("model.checkpoint=True"), 1, device="cuda", attention="flash"), GPUS["h200"])
    # every layer recomputed: one more forward of the blocks' GEMMs and attention (not the head's)
    tokens, layers = 2 * 256 * 2, 2
    head = 3 * tokens * 2 * 512 * 128 / (peak * eff["gemm"])
    attn_fwd = tokens * layers * (4 * 4 * 32 * 256 / 2) / (peak * eff["flash_fwd"])
    assert ckpt.terms["recompute"] == pytest.approx((base.terms["GEMM"] - head) / 3 + attn_fwd)
    piped = predict(estimate(_tiny("parallel.pipeline=2", world=2), 2, device="cuda", attention="flash"),
                    GPUS["h200"])
    compute = sum(piped.terms[k] for k in ("GEMM", "expert GEMM", "attention", "recompute", "memory-bound ops",
                                           "optimizer step"))
    assert piped.terms["pipeline bubble"] == pytest.approx(compute * (2 - 1) / 2)   # (pp - 1) / micro_num
    compiled = predict(estimate(_tiny("model.compile=True"), 1, device="cuda", attention="flash"), GPUS["h200"])
    assert compiled.terms["memory-bound ops"] == pytest.approx(base.terms["memory-bound ops"] / 2)


def _7b(tp, world=8, *sets):
    cfg = load_config("configs/7B.py", [f"parallel.tensor={tp}", *sets], world_size=world)
    return predict(estimate(cfg, world, device="cuda"), gpu_spec("h200"))


def test_more_tensor_parallel_more_exposed_communication():
    t1, t2, t4, t8 = (_7b(tp) for tp in (1, 2, 4, 8))
    assert "TP/SP collectives" not in t1.terms
    assert 0 < t2.terms["TP/SP collectives"] < t4.terms["TP/SP collectives"] < t8.terms["TP/SP collectives"]
    exposed = [sum(v for k, v in p.terms.items() if k.startswith(("exposed", "TP/SP"))) for p in (t1, t2, t4, t8)]
    assert exposed == sorted(exposed) and exposed[0] < exposed[-1]
    assert t8.mfu < t1.mfu


def test_sdpa_fallback_predicts_lower_mfu_than_flash():
    cfg = load_config("configs/7B.py", [], world_size=8)
    flash = predict(estimate(cfg, 8, device="cuda", attention="flash"), gpu_spec("h200"))
    sdpa = predict(estimate(cfg, 8, device="cuda", attention="sdpa"), gpu_spec("h200"))
    assert flash.kernels.attention == "flash" and sdpa.kernels.attention == "sdpa"
    assert sdpa.terms["attention"] > 2 * flash.terms["attention"]   # full rows at a lower rate
    assert sdpa.mfu < flash.mfu
    assert [default_attention(cfg, *have) for have in ((True, True), (False, True), (False, False))] == \
        ["flash", "torch_varlen", "sdpa"]   # numerics/kernels.py's order


def test_context_parallel_blockwise_core_is_memory_bound_and_slower():
    cfg = load_config("configs/7B_128k.py", [], world_size=64)
    flash = predict(estimate(cfg, 64, device="cuda", attention="flash"), gpu_spec("h200"))
    blockwise = predict(estimate(cfg, 64, device="cuda", attention="sdpa"), gpu_spec("h200"))
    assert (flash.kernels.context, blockwise.kernels.context) == ("flash", "blockwise")
    assert blockwise.terms["attention"] > 3 * flash.terms["attention"]
    assert "context exchange" in flash.terms and flash.terms["recompute"] > 0


def test_mixtral_counts_expert_gemm_and_all_to_all():
    cfg = load_config("configs/mixtral_8x7B.py", [], world_size=64)
    e = estimate(cfg, 64, device="cuda")
    grouped = predict(e, gpu_spec("h200"))
    loop = predict(e, gpu_spec("h200"), default_kernels(e, gpu_spec("h200"), "loop"))
    assert grouped.kernels == SpeedKernels("flash", "none", "grouped")
    assert grouped.terms["expert GEMM"] > grouped.terms["GEMM"] > 0 and grouped.terms["expert all-to-all"] > 0
    assert loop.terms["expert GEMM"] == pytest.approx(grouped.terms["expert GEMM"] * 0.60 / 0.50)


def test_gpu_table_by_name_and_unknown_gpu_refused():
    assert (gpu_spec("H200").peak_tflops, gpu_spec("h200").hbm_gbs, gpu_spec("h200").memory_gib) == (989, 4800, 141)
    assert (gpu_spec("a100").peak_tflops, gpu_spec("A100").arch) == (312, "ampere")
    assert gpu_spec("h100").hbm_gbs == 3350
    cfg = load_config("configs/7B.py", [], world_size=8)
    e = estimate(cfg, 8, device="cuda")
    assert predict(e, gpu_spec("a100")).step_time > predict(e, gpu_spec("h100")).step_time
    with pytest.raises(ConfigError) as err:
        gpu_spec("v100")
    assert str(err.value) == "--gpu v100: unknown GPU; expected one of h100, h200, a100"


def test_cli_prints_prediction_and_json():
    p = run_script("tools/estimate.py", ["--config", "configs/bench_gpu.py", "--gpu", "h200"], timeout=120)
    assert p.returncode == 0, p.stderr
    assert "time per step at MFU 50% of 989 TFLOP/s" in p.stdout   # the existing lines stay
    assert "predicted on H200 SXM 141GB" in p.stdout and "bound by: GEMM" in p.stdout
    assert "(fits in 141 GiB)" in p.stdout   # the table's memory
    mfu = {}
    for flags, attention in (([], "flash"), (["--no-flash-attn"], "torch_varlen"),
                             (["--no-flash-attn", "--no-torch-varlen"], "sdpa")):
        p = run_script("tools/estimate.py", ["--config", "configs/bench_gpu.py", "--gpu", "a100", "--json", *flags],
                       timeout=120)
        doc = json.loads(p.stdout)
        assert doc["peak_tflops"] == 312 and doc["prediction"]["gpu"] == "A100 SXM 80GB"
        assert doc["prediction"]["kernels"]["attention"] == doc["attention"] == attention
        mfu[attention] = doc["prediction"]["mfu"]
    assert mfu["flash"] == pytest.approx(mfu["torch_varlen"]) and mfu["sdpa"] < mfu["flash"] < 1
    p = run_script("tools/estimate.py", ["--config", "configs/bench_gpu.py"], timeout=120)
    assert p.returncode == 0 and "predicted" not in p.stdout
    p = run_script("tools/estimate.py", ["--config", "configs/bench_gpu.py", "--gpu", "v100"], timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip() == "error: --gpu v100: unknown GPU; expected one of h100, h200, a100"


def test_gpu_check_speed_rows_read_the_trainer_metrics(tmp_path):
    """bench/gpu_rows_speed.py's parts a CPU can run: the GPU name to the table's key, the median of the logged
    steps after warm-up (the row itself trains on a GPU)."""
    import sys

    from tests.helpers.launch import ROOT
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_rows_speed

    assert [gpu_rows_speed._gpu_key(n) for n in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB",
                                                 "NVIDIA H100 PCIe", "NVIDIA L40S")] == ["h200", "h100", "a100", "", ""]
    rows = [{"kind": "train", "step": s, "tgs": 1000.0 * s, "mfu": 0.01 * s} for s in range(1, 16)]
    rows.insert(3, {"kind": "valid", "step": 12, "tgs": 1.0})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert gpu_rows_speed.measured(tmp_path) == (13000.0, pytest.approx(0.13))   # steps 11-15
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[0]))
    with pytest.raises(RuntimeError, match="no train step after step 10 logged tgs"):
        gpu_rows_speed.measured(tmp_path)
