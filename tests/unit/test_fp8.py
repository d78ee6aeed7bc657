"""model.fp8 (config/fp8.py, parallel/float8.py): torchao's Float8Linear on CPU (torch._scaled_mm has CPU kernels
in torch 2.13): the spellings, the skip rule, forward and backward, a short training beside the high-precision one,
a bitwise resume, the refusals."""

from __future__ import annotations

import io
import logging
import sys

import pytest
import torch
import torch.nn as nn

from internlm_core.config.fp8 import Fp8Plan, fp8_plan
from internlm_core.errors import ConfigError
from internlm_core.model import build_model
from internlm_core.parallel.float8 import check_fp8_layout, convert_to_fp8
from tests.unit.test_model import small_cfg

pytest.importorskip("torchao.float8")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402


def tiny(seed: int = 0) -> nn.Module:
    """LLAMA, 2 layers, hidden 128, kv 64 wide, FFN 352 (a multiple of 16), vocab 97: every block linear is
    float8-able except none; the head (97) is outside the blocks."""
    torch.manual_seed(seed)
    return build_model(small_cfg("LLAMA", 2, hidden_size=128, num_attention_heads=4, multiple_of=16))


def blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.layers.values())


def test_spellings():
    assert fp8_plan(None) is None and fp8_plan(False) is None and fp8_plan("off") is None
    assert fp8_plan(True) == Fp8Plan("tensorwise")
    assert fp8_plan("rowwise") == Fp8Plan("rowwise")
    assert fp8_plan({"recipe_name": "tensorwise", "enable_fsdp_float8_all_gather": True, "filter_fqns": ["wo"]}) \
        == Fp8Plan("tensorwise", True, ("wo",))
    for bad, key in [("fp8", "model.fp8:"), ({"recipe_name": "mx"}, "model.fp8:"),
                     ({"recipe": "rowwise", "enable_fsdp_float8_all_gather": True}, "enable_fsdp_float8_all_gather"),
                     ({"min_features": 8}, "min_features"), ({"filter_fqns": "wo"}, "filter_fqns"),
                     ({"recipe_nam": "rowwise"}, "model.fp8.recipe_nam")]:
        with pytest.raises(ConfigError, match=key):
            fp8_plan(bad)


def test_config_key_is_checked_at_load():
    with pytest.raises(ConfigError, match="model.fp8"):
        small_cfg("LLAMA", fp8="float8")
    assert small_cfg("LLAMA", fp8="rowwise").model.fp8 == "rowwise"


def test_conversion_lists_exactly_the_expected_layers(caplog):
    model = tiny()
    # a block linear of 64 -> 8 (not a multiple of 16) and a residual-MoE style coefficient, to see the rule
    model.layers["0"].add_module("probe", nn.Linear(64, 8))
    model.layers["1"].add_module("coefficient", nn.Linear(128, 128))
    plan = Fp8Plan("tensorwise", filter_fqns=("layers.1.attention.wo",), min_features=64)
    with caplog.at_level(logging.INFO, logger="internlm_core.parallel.float8"):
        skipped = convert_to_fp8(model, blocks(model), plan)
    assert skipped == {"output": "outside the transformer blocks (output head)",
                       "layers.0.probe": "features (64, 8) not multiples of 16",
                       "layers.1.coefficient": "MoE routing",
                       "layers.1.attention.wo": "model.fp8.filter_fqns"}
    converted = sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))
    expect = sorted(f"layers.{i}.{s}" for i in (0, 1) for s in
                    ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                     "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"))
    assert converted == [n for n in expect if n != "layers.1.attention.wo"]
    assert isinstance(model.tok_embeddings, nn.Embedding) and not isinstance(model.output, Float8Linear)
    lines = [r.getMessage() for r in caplog.records if "model.fp8" in r.getMessage()]
    assert len(lines) == 1 and "recipe tensorwise, 13 linear layers in float8" in lines[0] and "layers.0.probe" in lines[0]


def test_small_layers_stay_in_high_precision():
    model = tiny()
    skipped = convert_to_fp8(model, blocks(model), Fp8Plan("rowwise", min_features=128))
    assert skipped["layers.0.attention.wk"] == "features (128, 64) below min_features 128"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_forward_backward_close_to_high_precision(recipe):
    ref, model = tiny(), tiny()
    convert_to_fp8(model, blocks(model), Fp8Plan(recipe))
    ids = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    out_ref, out = ref(ids), model(ids)
    out.float().pow(2).mean().backward()
    out_ref.float().pow(2).mean().backward()
    rel = (out - out_ref).norm() / out_ref.norm()
    assert 0 < rel < 0.1  # float8 rounding is visible but small
    g, g_ref = model.layers["0"].attention.wq.weight.grad, ref.layers["0"].attention.wq.weight.grad
    assert torch.isfinite(g).all() and 0 < (g - g_ref).norm() / g_ref.norm() < 0.2


def train(model: nn.Module, steps: int, opt: torch.optim.Optimizer, start: int = 0) -> list[float]:
    """`steps` AdamW steps on a learnable synthetic sequence task (each row counts up mod 97 from a random start)."""
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        ids = (torch.randint(0, 97, (4, 1), generator=g) + torch.arange(33)) % 97
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, 97), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_short_training_tracks_high_precision():
    ref, model = tiny(), tiny()
    convert_to_fp8(model, blocks(model), Fp8Plan("tensorwise"))
    base = train(ref, 30, torch.optim.AdamW(ref.parameters(), lr=3e-3))
    fp8 = train(model, 30, torch.optim.AdamW(model.parameters(), lr=3e-3))
    assert base[-1] < 0.5 * base[0]  # it learns
    end_ref, end = sum(base[-5:]) / 5, sum(fp8[-5:]) / 5
    assert abs(end - end_ref) / end_ref < 0.05, (end_ref, end)


def test_checkpoint_round_trip_resumes_bitwise():
    """Dynamic scaling keeps no state: the float8 model's state dict is the high-precision model's, and a resumed
    run continues bitwise."""
    model = tiny()
    assert set(convert_to_fp8(model, blocks(model), Fp8Plan("tensorwise"))) == {"output"}
    assert model.state_dict().keys() == tiny().state_dict().keys()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train(model, 3, opt)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    straight = train(model, 3, opt, start=3)

    resumed = tiny(seed=5)  # other initial weights: everything must come from the checkpoint
    convert_to_fp8(resumed, blocks(resumed), Fp8Plan("tensorwise"))
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=3e-3)
    buf.seek(0)
    state = torch.load(buf)
    resumed.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    assert train(resumed, 3, opt2, start=3) == straight
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


def test_refusals(monkeypatch):
    check_fp8_layout(Fp8Plan("tensorwise"), 2)  # tensor parallel: torchao's float8 styles
    check_fp8_layout(Fp8Plan("tensorwise", True), 1)  # the float8 all-gather, gloo included (as bytes)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails as where torchao is not installed
    with pytest.raises(ConfigError, match="model.fp8: needs torchao"):
        convert_to_fp8(tiny(), [], Fp8Plan("tensorwise"))


def test_trainer_converts_before_sharding_and_resumes_bitwise(tmp_path, caplog):
    """Through the real wiring (build_trainer on configs/tiny.py): converted on the meta device, materialized, and a
    run resumed from the step-2 checkpoint of a 4-step run ends bitwise where that run does."""
    from tests.unit.test_checkpoint import build, load_info

    with caplog.at_level(logging.INFO, logger="internlm_core.parallel.float8"):
        straight = build(tmp_path, "a", 4, "model.fp8=tensorwise", "ckpt.checkpoint_every=2")
    assert [r.getMessage() for r in caplog.records if "model.fp8" in r.getMessage()] == [
        "model.fp8: recipe tensorwise, 14 linear layers in float8; kept in high precision: "
        "output (outside the transformer blocks (output head))"]
    assert isinstance(straight.model.layers["0"].attention.wo, Float8Linear)
    straight.train()
    resumed = build(tmp_path, "b", 4, "model.fp8=tensorwise", load_info(tmp_path / "ckpt/2", "all"),
                    ckpt=tmp_path / "ckpt_b")
    assert resumed.state.step_count == 2
    resumed.train()
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_activation_checkpointing_recomputes_the_same_float8_numbers(tmp_path, policy, caplog):
    """Dynamic scales are recomputed from the same tensors in the recompute: checkpointed float8 training is bitwise
    the plain float8 training."""
    from tests.unit.test_checkpoint import build

    plain = build(tmp_path, "plain", 3, "model.fp8=tensorwise", ckpt=tmp_path / "c1")
    plain.train()
    with caplog.at_level(logging.INFO, logger="internlm_core.parallel"):
        ckpt = build(tmp_path, "ckpt", 3, "model.fp8=tensorwise", f"model.checkpoint={policy}", ckpt=tmp_path / "c2")
    assert any("activation checkpointing on 2 of 2 blocks" in r.getMessage() for r in caplog.records)
    ckpt.train()
    for (name, a), b in zip(plain.model.named_parameters(), ckpt.model.parameters()):
        assert torch.equal(a, b), name


def test_moe_routing_and_grouped_experts_stay_in_high_precision():
    """INTERNLM_MoE with a residual MLP: the router (a module holding a Parameter, not a linear) and the grouped experts (3-D
    Parameters) are never touched, the residual coefficient is skipped by name; attention and the dense residual
    MLP go to float8; forward and backward run."""
    from internlm_core.model import model_spec

    cfg = small_cfg("INTERNLM_MoE", hidden_size=128, num_attention_heads=4, multiple_of=16, num_experts=4,
                    moe_use_residual=True)
    torch.manual_seed(0)
    model = build_model(cfg)
    skipped = convert_to_fp8(model, model_spec(cfg.model_inputs()).plan.blocks(model), Fp8Plan("tensorwise"))
    experts = "MoE experts: 3-D weights, torchao's float8 recipes convert linears only (mxfp8 takes them)"
    assert skipped == {"layers.0.feed_forward.coefficient": "MoE routing",
                       "layers.1.feed_forward.coefficient": "MoE routing",
                       "output": "outside the transformer blocks (output head)",
                       # untouched, named in the log line too (they were left out of it)
                       "layers.0.feed_forward.gate": "MoE routing", "layers.1.feed_forward.gate": "MoE routing",
                       "layers.0.feed_forward.experts": experts, "layers.1.feed_forward.experts": experts}
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == {f"layers.{i}.{s}" for i in (0, 1) for s in
                         ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                          "feed_forward.shared_experts.w1", "feed_forward.shared_experts.w2",
                          "feed_forward.shared_experts.w3")}
    out = model(torch.randint(0, 97, (2, 32)))
    (out[0] if isinstance(out, tuple) else out).float().pow(2).mean().backward()
    experts = model.layers["0"].feed_forward.experts.w1
    assert experts.dim() == 3 and torch.isfinite(experts.grad).all() and experts.grad.abs().sum() > 0


def test_tensor_parallel_styles_are_torchaos_float8_ones_for_tensorwise():
    """TensorParallelOptions.linear_styles: the block plan's column / row styles become torchao's float8 ones for
    the Float8Linear modules (same layouts), under the tensorwise recipe only (tests/dist/test_fp8_fsdp.py trains
    tensor parallel 2 as one process)."""
    from torch.distributed.tensor import Shard
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from internlm_core.model.internlm.parallelize import block_plan
    from internlm_core.parallel.float8 import float8_tp_styles

    model = tiny()
    convert_to_fp8(model, blocks(model), Fp8Plan("tensorwise", filter_fqns=("feed_forward.w1",)))
    plan = block_plan(sequence_parallel=True)
    styled = float8_tp_styles(Fp8Plan("tensorwise"))(model.layers["0"], plan)
    assert type(styled["attention.wq"]) is Float8ColwiseParallel and styled["feed_forward.w1"] is plan["feed_forward.w1"]
    assert type(styled["feed_forward.w3"]) is Float8RowwiseParallel and styled["feed_forward.w3"].output_layouts == (Shard(1),)
    assert styled["attention"] is plan["attention"] and styled["attention_norm"] is plan["attention_norm"]
    assert float8_tp_styles(Fp8Plan("rowwise")) is None and float8_tp_styles(Fp8Plan("mxfp8_rceil")) is None

