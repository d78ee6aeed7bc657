"""Variants of the supported families (issue 36 item 5) against transformers' own modelling code: YaRN rope scaling
(Qwen2.5's long-context form, DeepSeek's mscale form) imports a folder transformers saved and exports one it loads,
logits within 1e-4 both ways at a sequence longer than the original length; the tables equal
transformers' ROPE_INIT_FUNCTIONS["yarn"] with its attention factor. Tiny random models, fp32, offline."""

import json
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
from internlm_core.model.layers import rotary_tables  # noqa: E402

T, V = 32, 320
SHAPE = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=T)
YARN = {  # name: (class, family, rope_parameters)
    "qwen2.5_yarn": ("Qwen2", "QWEN2", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                        "original_max_position_embeddings": 8}),
    "deepseek_mscale": ("Llama", "LLAMA", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0,
                                           "original_max_position_embeddings": 8, "mscale": 1.0,
                                           "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2}),
    "attention_factor_untruncated": ("Qwen3", "QWEN3", {"rope_type": "yarn", "rope_theta": 5e5, "factor": 2.0,
                                                        "original_max_position_embeddings": 16,
                                                        "attention_factor": 1.3, "truncate": False}),
}


def diff(model, hf):
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (model.eval()(ids) - hf(ids).logits).abs().max().item()


@pytest.mark.parametrize("case", list(YARN))
def test_yarn_both_ways(tmp_path, case):
    cls, family, rope = YARN[case]
    conf = getattr(transformers, f"{cls}Config")(**SHAPE, rope_parameters=dict(rope),
                                                 **({"head_dim": 16} if cls == "Qwen3" else {}))
    torch.manual_seed(0)
    hf = getattr(transformers, f"{cls}ForCausalLM")(conf).eval()
    hf.save_pretrained(tmp_path / "in")
    keys = config_from_hf(tmp_path / "in", family)
    assert keys["rope_scaling"]["rope_type"] == "yarn"
    cfg = load_config("configs/tiny.py", [f"model_type={family}", f"data.seq_len={T}", "model.dtype=torch.float32",
                                          *[f"{k if '.' in k else 'model.' + k}={v!r}" for k, v in keys.items()]])
    model = build_model(cfg)
    load_hf(model, tmp_path / "in")
    assert diff(model, hf) <= 1e-4
    export_hf(tmp_path / "out", cfg, model.state_dict(), tokenizer=None)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"]["rope_type"] == "yarn"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert diff(model, theirs) <= 1e-4


@pytest.mark.parametrize("case", list(YARN))
def test_yarn_tables_equal_transformers(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cls, _, rope = YARN[case]
    head_dim = 16
    conf = getattr(transformers, f"{cls}Config")(**SHAPE, rope_parameters=dict(rope), head_dim=head_dim)
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](conf, "cpu")
    freqs = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = rotary_tables(head_dim, T, rope["rope_theta"], {k: v for k, v in rope.items() if k != "rope_theta"})
    assert attention != 1.0
    assert torch.allclose(cos, emb.cos() * attention, atol=1e-6) and torch.allclose(sin, emb.sin() * attention,
                                                                                    atol=1e-6)


# Qwen's window on some layers only: (class, family, window keys, the layers that slide)
PARTIAL = {
    "qwen2_max_window_layers": ("Qwen2", "QWEN2", dict(max_window_layers=1), [1, 2]),
    "qwen3_layer_types": ("Qwen3", "QWEN3", dict(layer_types=["sliding_attention", "full_attention",
                                                              "sliding_attention"]), [0, 2]),
}


@pytest.mark.parametrize("case", list(PARTIAL))
def test_window_on_some_layers_both_ways(tmp_path, case):
    cls, family, kw, layers = PARTIAL[case]
    conf = getattr(transformers, f"{cls}Config")(**{**SHAPE, "num_hidden_layers": 3}, use_sliding_window=True,
                                                 sliding_window=6, **kw)
    torch.manual_seed(0)
    hf = getattr(transformers, f"{cls}ForCausalLM")(conf).eval()
    hf.save_pretrained(tmp_path / "in")
    keys = config_from_hf(tmp_path / "in", family)
    assert keys["sliding_window"] == 6 and keys["window_layers"] == layers
    cfg = load_config("configs/tiny.py", [f"model_type={family}", f"data.seq_len={T}", "model.dtype=torch.float32",
                                          *[f"{k if '.' in k else 'model.' + k}={v!r}" for k, v in keys.items()]])
    model = build_model(cfg)
    load_hf(model, tmp_path / "in")
    assert diff(model, hf) <= 1e-4
    every = load_config("configs/tiny.py", [f"model_type={family}", f"data.seq_len={T}", "model.dtype=torch.float32",
                                            *[f"{k if '.' in k else 'model.' + k}={v!r}" for k, v in keys.items()
                                              if k != "window_layers"]])
    with pytest.raises(CheckpointError, match=r"(layer_types|max_window_layers)=.* vs model.window_layers=None"):
        load_hf(build_model(every), tmp_path / "in")  # every layer windowed: another model, refused
    export_hf(tmp_path / "out", cfg, model.state_dict(), tokenizer=None)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert [t for t in theirs.config.layer_types] == ["sliding_attention" if i in layers else "full_attention"
                                                      for i in range(3)]
    assert diff(model, theirs) <= 1e-4
