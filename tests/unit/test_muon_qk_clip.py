"""optimizer.muon_qk_clip (MuonClip): model/qk_clip.py's per-head record of the largest pre-softmax logit against a
naive masked computation, and optim/muon.qk_clip after a step: heads above tau come back to tau (multi-head), none
stays above it (grouped-query: a shared key takes the smallest factor), heads below keep their rows bitwise; the
config's refusals; the trainer's wiring."""

from __future__ import annotations

import pytest
import torch

from internlm_core.config import build_config
from internlm_core.errors import ConfigError
from internlm_core.model import build_model
from internlm_core.model.attention import PackedMeta
from internlm_core.model.qk_clip import LogitMax, install_logit_records
from internlm_core.optim.muon import Muon, qk_clip
from tests.unit.test_model import small_cfg


def test_record_is_the_masked_maximum():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 40, 4, 8, generator=g), torch.randn(2, 40, 2, 8, generator=g)
    cu = torch.tensor([0, 15, 40, 52, 80], dtype=torch.int32)  # row 0: 15 + 25 tokens, row 1: 12 + 28
    rec = LogitMax()
    rec.observe(q, k, PackedMeta(cu_seqlens=cu, max_seqlen=28, mask=None))
    docs = torch.tensor([0] * 15 + [1] * 25 + [2] * 12 + [3] * 28).view(2, 40)
    kk = k.repeat_interleave(2, dim=2)
    logits = torch.einsum("bqhd,bkhd->bhqk", q, kk) / 8 ** 0.5
    pos = torch.arange(40)
    ok = (pos[None, :] <= pos[:, None])[None, None] & (docs[:, None, :, None] == docs[:, None, None, :])
    assert torch.allclose(rec.value, logits.masked_fill(~ok, float("-inf")).amax(dim=(0, 2, 3)))
    window = LogitMax()
    window.observe(q, k, PackedMeta(cu_seqlens=None, max_seqlen=40, mask=None, window=4))
    near = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 4)
    assert torch.allclose(window.value, logits.masked_fill(~near[None, None], float("-inf")).amax(dim=(0, 2, 3)))


def _max_logits(model, heads, ids):
    for h in heads:
        h.record.value = None
    with torch.no_grad():
        model(ids)
    return torch.stack([h.record.value for h in heads])


@pytest.mark.parametrize("kv", [4, 2], ids=["mha", "gqa"])
def test_clip_brings_every_head_to_tau(kv):
    torch.manual_seed(0)
    # one layer: a clip of an earlier layer would change a later one's inputs, hence its logits (as in Kimi-K2's
    # clip, which uses the step's own record)
    model = build_model(small_cfg("LLAMA", kv=kv, num_layers=1, hidden_size=64, num_attention_heads=4,
                                  multiple_of=16))
    heads = install_logit_records(model)
    assert len(heads) == 1 and heads[0].heads == 4 and heads[0].kv_heads == kv
    with torch.no_grad():  # heads 0 and 1 of each layer: logits far above the others'
        for h in heads:
            h.wq.weight[: 2 * h.head_dim] *= 8
    ids = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    before = _max_logits(model, heads, ids)
    tau = float(before[:, 2:].max()) * 1.5  # above every unscaled head, below the scaled ones
    assert (before[:, :2] > tau).all()
    kept = [h.wq.weight[2 * h.head_dim:].clone() for h in heads]
    opt = Muon([{"params": [p for p in model.parameters() if p.dim() >= 2], "use_muon": True}], lr=0.0,
               clip=lambda: qk_clip(heads, tau))
    model(ids).float().pow(2).mean().backward()
    opt.step()  # lr 0: only the clip moves the weights
    assert opt.last_clipped == 2
    after = _max_logits(model, heads, ids)
    assert (after <= tau * (1 + 1e-5)).all(), (after, tau)
    if kv == 4:  # each head its own key: exactly tau for the clipped ones, the others untouched
        assert torch.allclose(after[:, :2], torch.full_like(after[:, :2], tau), rtol=1e-5)
        assert torch.allclose(after[:, 2:], before[:, 2:])
    for h, w in zip(heads, kept):
        assert torch.equal(h.wq.weight[2 * h.head_dim:], w)  # heads below tau keep their W_q rows


def _cfg(**opt):
    return {"model_type": "LLAMA", "model": dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=97,
                                                 multiple_of=16, dtype="fp32"),
            "data": {"seq_len": 32, "micro_bsz": 2}, "optimizer": opt}


def test_config_refusals():
    assert build_config(_cfg(name="muon", muon_qk_clip=100.0)).optimizer.muon_qk_clip == 100.0
    with pytest.raises(ConfigError, match="optimizer.muon_qk_clip: expected a logit threshold > 0"):
        build_config(_cfg(name="muon", muon_qk_clip=0))
    with pytest.raises(ConfigError, match="optimizer.muon_qk_clip: a key of Muon"):
        build_config(_cfg(name="adamw", muon_qk_clip=50.0))
    qwen = build_model(small_cfg("QWEN3", hidden_size=64, num_attention_heads=4, multiple_of=16))
    with pytest.raises(ValueError, match="not with model.qk_norm"):
        install_logit_records(qwen)


def test_trainer_clips_through_the_optimizer(tmp_path, caplog):
    """build_trainer with optimizer.name=muon and a tau below the tiny model's logits: every step clips."""
    import logging

    from tests.unit.test_checkpoint import build

    with caplog.at_level(logging.INFO, logger="internlm_core.optim.optimizer"):
        trainer = build(tmp_path, "a", 2, "optimizer.name=muon", "optimizer.muon_qk_clip=0.01")
    assert any("qk-clip at 0.01 over 2 attention modules" in r.getMessage() for r in caplog.records)
    trainer.train()
    assert trainer.optimizer.last_clipped > 0
