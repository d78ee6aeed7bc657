"""Hugging Face MixtralForCausalLM interchange against transformers itself: our MIXTRAL family exports a folder
transformers loads with the same logits, and imports transformers' own saved Mixtral with the same logits (1e-4,
fp32, tiny random configs, offline)."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from internlm_core.checkpoint.hf import config_from_hf, export_hf, load_hf  # noqa: E402
from internlm_core.config import load_config  # noqa: E402
from internlm_core.errors import CheckpointError  # noqa: E402
from internlm_core.model import build_model  # noqa: E402

MIXTRAL = ["model_type=MIXTRAL", "model.vocab_size=300", "data.seq_len=64", "model.dtype=torch.float32",
           "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
           "model.num_kv_attention_heads=2", "model.intermediate_size=96", "model.num_experts=4", "moe.top_k=2",
           "model.moe_type=Dropless", "model.rope_base=1000000.0"]


def random_ours(overrides, seed=0):
    cfg = load_config("configs/tiny.py", overrides)
    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return cfg, model.eval()


def logits_diff(ours, theirs, vocab):
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (2, 48))
    with torch.no_grad():
        a, b = ours(ids), theirs(ids).logits
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def test_export_logits_equal_transformers(tmp_path):
    cfg, model = random_ours(MIXTRAL)
    export_hf(tmp_path, cfg, model.state_dict(), tokenizer=None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    assert hf.config.num_local_experts == 4 and hf.config.num_experts_per_tok == 2
    assert logits_diff(model, hf, 300) <= 1e-4


def test_import_logits_equal_transformers(tmp_path):
    conf = transformers.MixtralConfig(vocab_size=320, hidden_size=96, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, num_local_experts=6,
                                      num_experts_per_tok=3, max_position_embeddings=128, rope_theta=50000.0,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(3)
    hf = transformers.MixtralForCausalLM(conf).eval()
    with torch.no_grad():  # norms away from 1, so that a mis-mapped norm shows
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path, max_shard_size="200KB")
    keys = config_from_hf(tmp_path)
    assert keys["num_experts"] == 6 and keys["top_k"] == 3 and keys["moe_type"] == "Dropless"
    cfg = load_config("configs/tiny.py", ["model_type=MIXTRAL", "data.seq_len=64", "model.dtype=torch.float32",
                                          *[f"{k if '.' in k else 'model.' + k}={v!r}" for k, v in keys.items()]])
    assert cfg.moe.top_k == 3  # model.top_k is InternEvo's spelling of moe.top_k
    model = build_model(cfg)
    loaded = load_hf(model, tmp_path)
    assert set(loaded) >= {n for n, _ in model.named_parameters()}
    assert logits_diff(model.eval(), hf, 320) <= 1e-4


def test_export_refuses_what_mixtral_cannot_hold(tmp_path):
    for extra, message in ((["model.moe_type=GShard"], "routes dropless"),
                           (["model.moe_use_residual=True"], "no shared experts")):
        cfg, model = random_ours([*MIXTRAL, *extra])
        with pytest.raises(CheckpointError, match=message):
            export_hf(tmp_path / extra[0], cfg, model.state_dict(), tokenizer=None)
