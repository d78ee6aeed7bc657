"""model.fp8 with MXFP8 (config/fp8.py, parallel/mxfp8.py): torchao 0.18's MXFP8 weight wrapper, emulated on the CPU
(operands rounded to MXFP8, then multiplied in high precision): the spellings and refusals, the layers converted
and logged, forward / backward and a short training beside fp32, the MoE experts' grouped GEMM, a bitwise resume
through the trainer."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

from internlm_core.config.fp8 import Fp8Plan, fp8_plan
from internlm_core.errors import ConfigError
from internlm_core.parallel.float8 import check_fp8_layout, convert_to_fp8
from internlm_core.parallel.mxfp8 import mx_kernel
from tests.unit.test_fp8 import blocks, tiny, train
from tests.unit.test_model import small_cfg

pytest.importorskip("torchao.prototype.moe_training.tensor")
from torchao.prototype.moe_training.tensor import MXFP8TrainingWeightWrapperTensor as Wrapper  # noqa: E402

BLOCK_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
                 "feed_forward.w2", "feed_forward.w3")


def wrapped(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if isinstance(p, Wrapper)}


def test_spellings_and_refusals():
    assert fp8_plan("mxfp8") == Fp8Plan("mxfp8_rceil") and fp8_plan("mxfp8").mx
    assert fp8_plan({"recipe_name": "mxfp8_rceil_wgrad_with_hp"}).alignment == 32
    assert not fp8_plan("rowwise").mx
    for name in ("mxfp4", "nvfp4", "mxfp8_cublas"):
        with pytest.raises(ConfigError, match=f"model.fp8: '{name}' has no training recipe in torchao 0.18"):
            fp8_plan(name)
    with pytest.raises(ConfigError, match="enable_fsdp_float8_all_gather"):
        fp8_plan({"recipe_name": "mxfp8", "enable_fsdp_float8_all_gather": True})
    with pytest.raises(ConfigError, match="mxfp8_rceil not with parallel.tensor > 1"):
        check_fp8_layout(Fp8Plan("mxfp8_rceil"), 2)
    assert mx_kernel(Fp8Plan("mxfp8_rceil"), torch.device("cpu")) == "emulated"


def test_dense_layers_converted_logged_and_close_to_fp32(caplog):
    ref, model = tiny(), tiny()
    with caplog.at_level(logging.INFO, logger="internlm_core.parallel.float8"):
        skipped = convert_to_fp8(model, blocks(model), fp8_plan("mxfp8"))
    assert skipped == {"output": "outside the transformer blocks (output head)"}
    assert wrapped(model) == {f"layers.{i}.{s}.weight" for i in (0, 1) for s in BLOCK_LINEARS}
    assert [r.getMessage() for r in caplog.records if "model.fp8" in r.getMessage()] == [
        "model.fp8: recipe mxfp8_rceil, 14 layers in mxfp8, GEMMs emulated (dequantized, then high precision); "
        "kept in high precision: output (outside the transformer blocks (output head))"]
    ids = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    out, out_ref = model(ids), ref(ids)
    out.float().pow(2).mean().backward()
    out_ref.float().pow(2).mean().backward()
    assert 0 < ((out - out_ref).norm() / out_ref.norm()).item() < 0.1  # MXFP8 rounding: visible, small
    g, g_ref = model.layers["0"].attention.wq.weight.grad, ref.layers["0"].attention.wq.weight.grad
    assert type(g) is torch.Tensor and 0 < ((g - g_ref).norm() / g_ref.norm()).item() < 0.2


def test_bias_stays_a_plain_parameter_added_outside_the_gemm():
    """torchao 0.18's F.linear override drops a bias: the project's Linear (InternLM's q/k/v/o have biases) adds
    it itself, and the bias learns as in high precision."""
    from internlm_core.model.layers import Linear

    torch.manual_seed(0)
    ref = nn.Sequential(Linear(64, 128, bias=True))
    nn.init.normal_(ref[0].bias)
    model = nn.Sequential(Linear(64, 128, bias=True))
    model.load_state_dict(ref.state_dict())
    convert_to_fp8(model, [model], fp8_plan("mxfp8"))
    assert wrapped(model) == {"0.weight"} and type(model[0].bias) is nn.Parameter
    x = torch.randn(64, 64)
    out, out_ref = model(x), ref(x)
    assert ((out - out_ref).norm() / out_ref.norm()).item() < 0.1
    out.pow(2).sum().backward()
    out_ref.pow(2).sum().backward()
    g, g_ref = model[0].bias.grad, ref[0].bias.grad
    assert 0 < ((g - g_ref).norm() / g_ref.norm()).item() < 0.05


def test_autocast_casts_both_operands():
    """One process, 16-bit compute over fp32 parameters: torchao's override runs before autocast would cast, so the
    linear casts input and weight itself (a bf16 input beside an fp32 weight failed in the emulated GEMM)."""
    from internlm_core.model.layers import Linear

    torch.manual_seed(0)
    model = nn.Sequential(Linear(64, 128, bias=True))
    ref = nn.Sequential(Linear(64, 128, bias=True))
    ref.load_state_dict(model.state_dict())
    convert_to_fp8(model, [model], fp8_plan("mxfp8"))
    x = torch.randn(64, 64).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, out_ref = model(x), ref(x)
    assert out.dtype == torch.bfloat16 and ((out - out_ref).float().norm() / out_ref.float().norm()).item() < 0.1
    out.float().sum().backward()
    assert model[0].weight.grad.dtype == torch.float32 and torch.isfinite(model[0].weight.grad).all()


def test_short_training_tracks_fp32():
    ref, model = tiny(), tiny()
    convert_to_fp8(model, blocks(model), fp8_plan("mxfp8"))
    base = train(ref, 8, torch.optim.AdamW(ref.parameters(), lr=3e-3))
    mx = train(model, 8, torch.optim.AdamW(model.parameters(), lr=3e-3))
    assert base[-1] < 0.85 * base[0]  # it learns
    assert abs(mx[-1] - base[-1]) / base[-1] < 0.03, (base, mx)
    assert mx != base  # MXFP8 was really on


def test_moe_experts_take_the_mxfp8_grouped_gemm():
    from internlm_core.model import build_model, model_spec
    from internlm_core.model.moe.experts import grouped_mm_available

    if not grouped_mm_available(torch.device("cpu"), torch.float32):
        pytest.skip("no fp32 grouped GEMM on this torch's CPU")
    cfg = small_cfg("INTERNLM_MoE", hidden_size=128, num_attention_heads=4, multiple_of=32, num_experts=4)
    torch.manual_seed(0)
    ref = build_model(cfg)
    for m in ref.modules():
        if hasattr(m, "gemm"):
            m.gemm = "grouped"
    model = build_model(cfg)
    model.load_state_dict(ref.state_dict())
    for m in model.modules():
        if hasattr(m, "gemm"):
            m.gemm = "grouped"
    blk = model_spec(cfg.model_inputs()).plan.blocks
    loop = build_model(cfg)
    assert "layers.0.feed_forward.experts" in convert_to_fp8(loop, blk(loop), fp8_plan("mxfp8"))
    convert_to_fp8(model, blk(model), fp8_plan("mxfp8"), grouped_experts=True)
    assert {n for n in wrapped(model) if "experts" in n} == {f"layers.{i}.feed_forward.experts.{w}"
                                                             for i in (0, 1) for w in ("w1", "w2", "w3")}
    assert not any("gate" in n for n in wrapped(model))  # routing stays exact
    ids = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(2))
    out, out_ref = (m(ids) for m in (model, ref))
    out, out_ref = (o[0] if isinstance(o, tuple) else o for o in (out, out_ref))
    out.float().pow(2).mean().backward()
    assert 0 < ((out - out_ref).norm() / out_ref.norm()).item() < 0.1
    g = model.layers["0"].feed_forward.experts.w1.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
    for m in model.modules():  # a wrapped expert weight on the per-expert loop: refused, not multiplied silently
        if hasattr(m, "gemm"):
            m.gemm = "loop"
    with pytest.raises(ConfigError, match="only the grouped GEMM honours"):
        model(ids)


def test_trainer_resumes_bitwise(tmp_path):
    """Through build_trainer (configs/tiny.py, meta device, materialized, initialized by name): the wrapped weights
    save and load as plain ones, and a run resumed at step 2 ends bitwise where the straight run does."""
    from tests.unit.test_checkpoint import build, load_info

    straight = build(tmp_path, "a", 4, "model.fp8=mxfp8", "ckpt.checkpoint_every=2")
    assert isinstance(straight.model.layers["0"].attention.wo.weight, Wrapper)
    straight.train()
    resumed = build(tmp_path, "b", 4, "model.fp8=mxfp8", load_info(tmp_path / "ckpt/2", "all"),
                    ckpt=tmp_path / "ckpt_b")
    assert resumed.state.step_count == 2
    resumed.train()
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
