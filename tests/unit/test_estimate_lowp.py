"""The estimator's fp8 and Muon terms (estimate/lowp.py) on configs/tiny.py, against hand-computed figures:
INTERNLM, 2 layers, hidden 128, FFN 384, seq 256, 2 x 2 micro-batches; every block matrix (wq, wk, wv, wo 128 x 128;
w1, w2 384 x 128; w3 128 x 384) passes config/fp8.py's rule: 4 * 128 * 128 + 3 * 384 * 128 = 212,992 elements."""

import pytest

from internlm_core.config import load_config
from internlm_core.errors import ConfigError
from internlm_core.estimate import estimate
from internlm_core.estimate.gpus import EFFICIENCY, GPUS
from internlm_core.estimate.lowp import low_precision
from internlm_core.estimate.speed import predict

BLOCK = 4 * 128 * 128 + 3 * 384 * 128
LAYERS, TOKENS = 2, 2 * 256  # one micro-batch's tokens
GATHER = "{'recipe_name': 'tensorwise', 'enable_fsdp_float8_all_gather': True}"


def _est(*sets, world=1, **kw):
    cfg = load_config("configs/tiny.py", ["model.dtype='torch.bfloat16'", *sets], world_size=world)
    return estimate(cfg, world, device="cuda", attention="flash", **kw)


def test_fp8_drops_the_autocast_copies_and_adds_the_casts():
    base, fp8 = _est(), _est("model.fp8=tensorwise")
    assert fp8.low_precision.converted_local == BLOCK
    # one device, bf16 autocast caches a 16-bit copy of each weight: none of the converted ones under fp8
    assert base.memory.weight_copies - fp8.memory.weight_copies == 2 * LAYERS * BLOCK
    # the largest converted linear (384 x 128): weight and transpose, input and gradient in both layouts, 4 scales
    assert fp8.memory.fp8_casts == 2 * 384 * 128 + 2 * TOKENS * (128 + 384) + 16
    rowwise = _est("model.fp8=rowwise")
    assert rowwise.memory.fp8_casts == 2 * 384 * 128 + 2 * TOKENS * (128 + 384) + 8 * (TOKENS + 384)
    assert base.memory.fp8_casts == 0 and fp8.memory.total > base.memory.total - 2 * LAYERS * BLOCK


def test_float8_all_gather_halves_the_gathered_block_weights():
    """FSDP over 2 ranks gathers bf16 weights; the float8 all-gather sends the converted ones in 1 byte."""
    base, gather = _est(world=2), _est(f"model.fp8={GATHER}", world=2)
    gathers = LAYERS * 2 * 2  # each block gathered for forward and backward, every micro-batch
    assert base.communication.gathered_bytes - gather.communication.gathered_bytes == gathers * BLOCK
    assert base.memory.fsdp_gathered - gather.memory.fsdp_gathered == 2 * BLOCK  # the running and prefetched block
    gib = gather.communication.gathered_bytes / 2**30
    assert any(n.startswith(f"FSDP per step: {gib:.2f} GiB gathered") for n in gather.notes), gather.notes
    plain = _est("model.fp8=tensorwise", world=2)
    assert plain.communication.gathered_bytes == base.communication.gathered_bytes


def test_muon_keeps_one_buffer_and_gathers_each_cut_matrix():
    adamw, muon = _est(world=2), _est("optimizer.name=muon", world=2)
    assert adamw.memory.optimizer - muon.memory.optimizer == 4 * LAYERS * BLOCK / 2  # FSDP shards the buffer too
    assert muon.muon_gather_bytes == 4 * LAYERS * BLOCK  # every cut matrix whole, in fp32, every step
    assert _est("optimizer.name=muon").muon_gather_bytes == 0  # one device: nothing is cut
    ns = 4 * 5 * 6 * 128 ** 3 + 3 * 5 * (4 * 128 ** 2 * 384 + 2 * 128 ** 3)  # 5 steps, m <= n
    assert muon.low_precision.ns_flops == ns
    assert any("optimizer muon: one fp32 momentum buffer" in n for n in muon.notes)


def test_speed_prices_the_converted_gemms_at_the_float8_rate():
    gpu, eff = GPUS["h200"], EFFICIENCY["hopper"]
    assert gpu.fp8_tflops == 2 * gpu.peak_tflops and GPUS["a100"].fp8_tflops == 0
    peak, hbm, tokens = 989e12, 4800e9 * eff["hbm"], TOKENS * 2
    base, fp8 = predict(_est(), gpu), predict(_est("model.fp8=tensorwise"), gpu)
    block_gemm = 3 * tokens * LAYERS * 2 * BLOCK / (peak * eff["gemm"])
    assert base.terms["GEMM"] - fp8.terms["GEMM"] == pytest.approx(block_gemm / 2)
    casts = 2 * (4 * 256 + 3 * 512) * (2 * 2 + 1) * tokens * LAYERS  # (in + out) per linear, bf16 read twice
    assert fp8.terms["float8 casts"] == pytest.approx(casts / hbm)
    muon = predict(_est("optimizer.name=muon", world=2), gpu)
    assert muon.terms["Muon Newton-Schulz"] == pytest.approx(
        LAYERS * _est("optimizer.name=muon").low_precision.ns_flops / (peak * eff["gemm"]))
    assert muon.terms["Muon all-gather"] == pytest.approx(4 * LAYERS * BLOCK / 2 / (450e9 * eff["link"]))


def test_refusals_and_internlm_accounting():
    with pytest.raises(ConfigError, match="H200 SXM 141GB has no MXFP8 GEMMs"):
        predict(_est("model.fp8=mxfp8"), GPUS["h200"])
    with pytest.raises(ConfigError, match="A100 SXM 80GB has no float8 GEMMs"):
        predict(_est("model.fp8=tensorwise"), GPUS["a100"])
    cfg = load_config("configs/tiny.py", ["model.fp8=tensorwise"])
    assert estimate(cfg, 1, precision="internlm").memory.fp8_casts == 0


def test_the_rule_matches_the_converted_model():
    """The estimator's choice of linears is the converter's: same elements as the Float8Linear weights."""
    pytest.importorskip("torchao.float8")
    from internlm_core.model import build_model, model_spec
    from internlm_core.parallel.float8 import convert_to_fp8

    from internlm_core.config.fp8 import fp8_plan

    fp8 = {"recipe_name": "rowwise", "filter_fqns": ["attention.wo"], "min_features": 128}
    cfg = load_config("configs/tiny.py", [f"model.fp8={fp8}", "model.num_layers=1"])
    model = build_model(cfg.model_inputs(), "meta")
    convert_to_fp8(model, model_spec(cfg.model_inputs()).plan.blocks(model), fp8_plan(fp8))
    from torchao.float8.float8_linear import Float8Linear
    elements = sum(m.weight.numel() for m in model.modules() if isinstance(m, Float8Linear))
    e = estimate(cfg, 1)
    assert low_precision(cfg, e.figures.block.linears, e.layout).converted_local == elements == BLOCK - 128 * 128
