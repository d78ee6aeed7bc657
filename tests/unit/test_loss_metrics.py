"""FlashGPTLMLoss against a reference cross entropy; AccPerplex against hand-computed values."""

import math

import pytest
import torch
import torch.nn.functional as F

from internlm_core.loss import FlashGPTLMLoss
from internlm_core.metrics import AccPerplex, Throughput


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_loss_equals_reference_cross_entropy(smoothing):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 11, generator=g)
    labels = torch.randint(0, 11, (2, 7), generator=g)
    labels[0, 3] = labels[1, 6] = -100
    ours, _ = FlashGPTLMLoss(label_smoothing=smoothing)(logits, labels)
    ref = F.cross_entropy(logits.view(-1, 11), labels.view(-1), ignore_index=-100, label_smoothing=smoothing)
    assert torch.allclose(ours, ref, atol=1e-6)
    # hand check of the unsmoothed value for one token
    if smoothing == 0:
        lp = torch.log_softmax(logits.view(-1, 11), -1)
        valid = labels.view(-1) != -100
        manual = -lp[valid, labels.view(-1)[valid]].mean()
        assert torch.allclose(ours, manual, atol=1e-6)


def test_loss_with_no_valid_label_is_zero_not_nan():
    logits = torch.randn(4, 5, requires_grad=True)
    loss, _ = FlashGPTLMLoss()(logits, torch.full((4,), -100))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.all(logits.grad == 0)


def test_accperplex_hand_computed_with_types():
    # 4 tokens, vocab 3; logits chosen so that argmax is known
    logits = torch.tensor([[5.0, 0.0, 0.0],   # predicts 0, label 0 (right), type 0
                           [0.0, 5.0, 0.0],   # predicts 1, label 2 (wrong), type 0
                           [0.0, 0.0, 5.0],   # predicts 2, label 2 (right), type 1
                           [5.0, 0.0, 0.0]])  # ignored
    labels = torch.tensor([0, 2, 2, -100])
    types = torch.tensor([0, 0, 1, 1])
    m = AccPerplex({0: "en", 1: "code"})
    m.update(logits, labels, types)
    out = m.get_metric()
    ce = [-torch.log_softmax(logits[i], -1)[labels[i]].item() for i in range(3)]
    assert out["tokens"] == 3
    assert out["acc"] == pytest.approx(2 / 3)
    assert out["ppl"] == pytest.approx(math.exp(sum(ce) / 3), rel=1e-6)
    assert out["acc/en"] == pytest.approx(0.5) and out["acc/code"] == pytest.approx(1.0)
    assert out["loss/en"] == pytest.approx((ce[0] + ce[1]) / 2, rel=1e-6)
    assert out["loss/code"] == pytest.approx(ce[2], rel=1e-6)
    assert m.get_metric()["tokens"] == 0  # reset after reading


def test_accperplex_reuses_given_token_losses_and_accumulates():
    logits = torch.randn(6, 10)
    labels = torch.randint(0, 10, (6,))
    _, side = FlashGPTLMLoss()(logits, labels)
    a, b = AccPerplex(), AccPerplex()
    for _ in range(2):
        a.update(logits, labels, None, side.token_losses, side.predictions)
        b.update(logits, labels)
    ra, rb = a.get_metric(), b.get_metric()
    assert ra["tokens"] == 12 and ra["ppl"] == pytest.approx(rb["ppl"], rel=1e-6)


def test_throughput_formula():
    t = Throughput(flops_per_token=1_000_000, world_size=2, peak_flops=1e9)
    out = t.compute(tokens=4000, seconds=2.0)
    assert out["tgs"] == 1000.0  # per device
    assert out["tflops"] == pytest.approx(1e9 / 1e12)
    assert out["mfu"] == pytest.approx(1.0)
    assert Throughput(1, 1, None).compute(10, 1.0)["mfu"] is None


def test_flops_per_token_matches_peer_benchmark_formula():
    from internlm_core.config import build_config
    from internlm_core.model import model_args_from_config, flops_per_token
    cfg = build_config({"model_type": "LLAMA", "model": dict(vocab_size=8192, hidden_size=256, num_layers=4,
                        num_attention_heads=4, intermediate_size=688), "data": {"seq_len": 512}})
    assert flops_per_token(model_args_from_config(cfg), 512) == 37_860_864  # ../shared/bench/peers/README.md


def test_peak_override_from_the_environment(monkeypatch, caplog):
    from internlm_core.utils.peak import device_peak_flops
    monkeypatch.setenv("INTERNLM_CORE_PEAK_TFLOPS", "2.5")
    assert device_peak_flops(torch.device("cpu"), torch.bfloat16) == 2.5e12
    assert device_peak_flops(torch.device("meta"), torch.float32) == 2.5e12  # any device: the user's number
    monkeypatch.setenv("INTERNLM_CORE_PEAK_TFLOPS", "fast")
    assert device_peak_flops(torch.device("meta"), torch.float32) is None
    assert "INTERNLM_CORE_PEAK_TFLOPS='fast' is not a positive number: ignored" in caplog.text


def test_cpu_peak_is_best_seen_and_gpu_table(tmp_path):
    import json
    from internlm_core.utils.peak import _cpu_key, cpu_peak_flops, gpu_peak_flops
    cache = tmp_path / "peak.json"
    first = cpu_peak_flops(torch.float32, cache)
    assert 1e9 < first < 1e14
    cache.write_text(json.dumps({_cpu_key(torch.float32): 1e15}))
    assert cpu_peak_flops(torch.float32, cache) == 1e15  # a better earlier reading wins
    assert gpu_peak_flops("NVIDIA H200", torch.bfloat16) == 989e12
    # fp32 is TF32's peak only when TF32 is on (torch.tf32); plain fp32 runs without tensor cores
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", torch.float32, tf32=True) == 156e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", torch.float32) == 19.5e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.float32) == 67e12
    # PCIe and NVL variants have their own (lower) peaks; H20 is not H200
    assert gpu_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert gpu_peak_flops("NVIDIA H100 NVL", torch.bfloat16) == 835e12
    assert gpu_peak_flops("NVIDIA H20", torch.bfloat16) == 148e12
    assert gpu_peak_flops("Some Future GPU", torch.bfloat16) is None
