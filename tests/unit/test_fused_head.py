"""The fused output head + cross entropy (issue 38 item 3, internlm_core/fused_head.py): the loss, the metrics'
per-token cross entropy and argmax, and the gradients of the hidden states and the head weight equal the unfused
head (F.linear, then FlashGPTLMLoss's torch kernel) to 1e-5 in fp32, with label smoothing and z-loss, over several
chunks; at vocabulary 152K the measured peak of live tensors is lower by more than the logits' bytes; the config's
choice ("auto" by the logits' size; refused in one line under pipeline parallel)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import internlm_core.fused_head as fused_head
from internlm_core.config.recompute import fused_head_enabled
from internlm_core.errors import ConfigError
from internlm_core.fused_head import fused_head_cross_entropy
from internlm_core.loss import FlashGPTLMLoss
from tests.helpers.live_tensors import LiveTensorBytes


def _unfused(x, w, labels, smoothing, z):
    logits = F.linear(x, w)
    loss, _ = FlashGPTLMLoss("torch", label_smoothing=smoothing)(logits, labels)
    valid = labels != -100
    lse = torch.logsumexp(logits, dim=-1)
    return loss + z * (lse * lse * valid).sum() / valid.sum(), logits


@pytest.mark.parametrize("smoothing,z", [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-3), (0.1, 1e-3)])
def test_equals_the_unfused_head(monkeypatch, smoothing, z):
    monkeypatch.setitem(fused_head.CHUNK_BYTES, "cpu", 4 * 1000 * 7)  # chunks of 7 rows: 9 chunks
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 32, generator=g, requires_grad=True)
    w = (0.3 * torch.randn(1000, 32, generator=g)).requires_grad_()
    labels = torch.randint(0, 1000, (60,), generator=g)
    labels[[3, 17, 40]] = -100
    ref, logits = _unfused(x, w, labels, smoothing, z)
    ref_x, ref_w = torch.autograd.grad(ref, (x, w))
    token_losses, ce, argmax = fused_head_cross_entropy(x, w, labels, smoothing, z)
    valid = labels != -100
    loss = token_losses.sum() / valid.sum()
    gx, gw = torch.autograd.grad(loss, (x, w))
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gx, ref_x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw, ref_w, atol=1e-5, rtol=1e-5)
    plain = F.cross_entropy(logits.detach(), labels, ignore_index=-100, reduction="none")
    torch.testing.assert_close(ce, plain, atol=1e-5, rtol=1e-5)  # perplexity's per-token loss, also smoothed
    assert torch.equal(argmax, logits.detach().argmax(dim=-1))  # accuracy's predictions


def test_peak_at_vocab_152k_is_lower_by_the_logits():
    """1024 tokens, hidden 32, vocabulary 151,936 (Qwen's), fp32: the logits are 622 MB."""
    tokens, hidden, vocab = 1024, 32, 151936
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    w = (0.05 * torch.randn(vocab, hidden, generator=g)).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    peaks = {}
    for name in ("unfused", "fused"):
        x.grad = w.grad = None
        with LiveTensorBytes(exclude=[x, w]) as live:
            if name == "unfused":
                loss, _ = FlashGPTLMLoss("fused_chunked")(F.linear(x, w), labels)
            else:
                loss = fused_head_cross_entropy(x, w, labels)[0].mean()
            loss.backward()
        peaks[name] = live.peak
    logits = 4 * tokens * vocab
    assert peaks["unfused"] - peaks["fused"] > logits, (peaks, logits)
    # what is left: the weight's gradient (returned; no accumulator of its size), the hidden states' fp32 gradient
    # and two chunks' fp32 temporaries (measured: 34.7 MiB = 18.5 + 0.1 + 2 x 8)
    weight = 4 * vocab * hidden
    assert peaks["fused"] < weight + 2 * 4 * tokens * hidden + 2.5 * fused_head.CHUNK_BYTES["cpu"], (peaks, logits)


def test_choice():
    assert fused_head_enabled("auto", 151936, 2048, 1, 1, False)  # 1.2 GB of logits
    assert not fused_head_enabled("auto", 512, 512, 1, 1, False)
    assert fused_head_enabled("auto", 151936, 8192, 2, 1, False)  # pipeline: the last stage's loss applies the head
    assert fused_head_enabled(True, 512, 512, 1, 2, False) and not fused_head_enabled(False, 151936, 8192, 1, 1, False)
    # tensor + sequence parallel: the head gathers its sequence-sharded input (tests/dist/test_fused_head_tp.py)
    assert fused_head_enabled(True, 512, 512, 1, 2, True) and fused_head_enabled("auto", 151936, 2048, 1, 2, True)
    assert fused_head_enabled(True, 512, 512, 2, 1, False)
    with pytest.raises(ConfigError, match="model.fused_head_loss: expected True, False or \"auto\", got 'yes'"):
        fused_head_enabled("yes", 512, 512, 1, 1, False)


def _micro_batch_peak(cfg) -> int:
    """Peak bytes of the tensors a training micro-batch creates through the fused head (as the trainer runs it:
    the model stopped before its output layer, the loss applying it), gradients of an earlier one existing."""
    from internlm_core.fused_head import FusedHead
    from internlm_core.model import build_model

    torch.manual_seed(0)
    model = build_model(cfg)
    loss_fn = FlashGPTLMLoss("fused_chunked")
    loss_fn.fused_head = FusedHead(model)
    for _ in range(2):
        ids = torch.randint(0, cfg.model.vocab_size, (cfg.data.micro_bsz, cfg.data.seq_len))
        params = list(model.parameters())
        with LiveTensorBytes(exclude=params + [p.grad for p in params]) as live:
            with loss_fn.fused_head.deferred():
                hidden = model(ids, None, None)
            loss, side = loss_fn.fused(hidden, ids)
            del hidden, side
            (loss / 2).backward()
    return live.peak


def test_estimate_of_the_fused_head_within_15_percent_of_the_measured_peak():
    """Vocabulary 32K, 1024 tokens, fp32: unfused, the logits (128 MiB) and the loss's stored gradient would be the
    largest terms; fused, the estimate has no logits term and stays within 15% of the measured peak."""
    from internlm_core.config.loader import load_config
    from internlm_core.estimate import estimate

    over = ["model.vocab_size=32768", "model.hidden_size=128", "data.seq_len=512", "data.micro_bsz=2",
            "model.dtype=torch.float32"]
    cfg = load_config("configs/tiny.py", [*over, "model.fused_head_loss=True"])
    m = estimate(cfg, 1, device="cpu").memory
    unfused = estimate(load_config("configs/tiny.py", [*over, "model.fused_head_loss=False"]), 1, device="cpu").memory
    logits = 4 * 1024 * 32768
    # the logits (in the loss forward's transients: dropped before backward) and what the loss keeps of them
    assert (unfused.activations + unfused.loss_peak) - (m.activations + m.loss_peak) >= logits
    predicted = m.activations + m.weight_copies + m.gemm_copies + m.loss_peak  # what a micro-batch adds
    measured = _micro_batch_peak(cfg)
    assert abs(predicted / measured - 1) < 0.15, (predicted / 2**20, measured / 2**20)


def test_auto_is_the_estimators_choice(tmp_path):
    """model.fused_head_loss = "auto" (the default): fused where the estimated peak is lower by at least 256 MiB on
    the device's loss kernel: 7B at 128K tokens on GPUs, not Qwen3-8B at 4K (flash-attn's in-place loss keeps only
    the bf16 logits), not a small model; the trainer takes the estimator's decision."""
    from internlm_core.config import load_config
    from internlm_core.distributed import LaunchInfo
    from internlm_core.estimate import estimate
    from internlm_core.estimate.fit import fused_head_chosen
    from internlm_core.estimate.fused_choice import AUTO_MIN_SAVING
    from internlm_core.trainer.build import build_trainer
    from internlm_core.utils.cpu_features import CpuFeatures, pinned

    long = load_config("configs/7B_128k.py", ["model.fused_head_loss=auto"], world_size=64)
    qwen = load_config("configs/qwen3_8B.py", ["model.fused_head_loss=auto"], world_size=8)
    chosen, off = estimate(long, 64), estimate(load_config("configs/7B_128k.py", ["model.fused_head_loss=False"],
                                                           world_size=64), 64)
    assert chosen.cross_entropy == "fused_head" and chosen.memory.total <= off.memory.total - AUTO_MIN_SAVING
    assert any(n.startswith('model.fused_head_loss="auto": fused head') for n in chosen.notes), chosen.notes
    assert estimate(qwen, 8).cross_entropy == "flash"
    assert fused_head_chosen(long, 64, "cuda") and not fused_head_chosen(qwen, 8, "cuda")
    small = load_config("configs/tiny.py", [])
    # a CPU run with a large vocabulary: 1 GiB of fp32 logits per micro-batch; the trainer fuses, as estimated
    big = load_config("configs/tiny.py", ["model.vocab_size=65536", "data.seq_len=2048", "data.total_steps=1",
                                          "monitor.tensorboard=False"])
    half = load_config("configs/tiny.py", ["model.vocab_size=65536", "data.seq_len=2048",
                                           "model.dtype=torch.bfloat16"])
    for features in (CpuFeatures.NATIVE, CpuFeatures.EMULATED):  # the CPU's linear path moves the peaks
        with pinned(features):
            assert small.model.fused_head_loss == "auto" and not fused_head_chosen(small, 1, "cpu")
            assert estimate(big, 1, device="cpu").cross_entropy == "fused_head"
            assert estimate(half, 1, device="cpu").cross_entropy == "fused_head"
    (tmp_path / "run").mkdir()
    trainer = build_trainer(big, LaunchInfo("none", 0, 1, 0, torch.device("cpu"), None), tmp_path / "run")
    assert trainer.loss_fn.fused_head is not None
