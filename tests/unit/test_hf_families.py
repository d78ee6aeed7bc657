"""The model families against transformers' own modelling code (tiny random configs, fp32, offline): each imports a
folder transformers saved with logits within 1e-4, and exports a folder transformers loads with logits within 1e-4;
Llama 3 tied and untied with rope scaling, Qwen2.5's q/k/v bias, Qwen3's q/k norm and head_dim, Mistral's sliding
window (shorter than the sequence, in every attention kernel's document mask), Qwen3-MoE's experts; the rotary
tables against transformers' ROPE_INIT_FUNCTIONS."""

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from internlm_core.checkpoint.hf import config_from_hf, export_hf, load_hf  # noqa: E402
from internlm_core.config import load_config  # noqa: E402
from internlm_core.errors import CheckpointError, ConfigError  # noqa: E402
from internlm_core.model import (analytic_parameter_count, build_model, build_packed_meta,  # noqa: E402
                                 count_parameters, model_args)
from internlm_core.model.attention import _causal_document_mask, block_document_masks  # noqa: E402
from internlm_core.model.layers import rotary_tables  # noqa: E402

T, V = 32, 320  # tokens per row (data.seq_len), vocabulary
SHAPE = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=T, rms_norm_eps=1e-6)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

# (model_type, transformers class, its config's keys beyond SHAPE)
CASES = {
    "llama3_untied": ("LLAMA3", "Llama", dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False)),
    "llama3_tied_linear": ("LLAMA3", "Llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 5e5,
                                                                    "factor": 4.0}, tie_word_embeddings=True)),
    "qwen2_bias_dynamic": ("QWEN2", "Qwen2", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e6,
                                                                   "factor": 2.0}, max_position_embeddings=16)),
    "qwen3_norm_head_dim": ("QWEN3", "Qwen3", dict(head_dim=32, rope_parameters={"rope_type": "default",
                                                                                 "rope_theta": 1e6})),
    "mistral_window": ("MISTRAL", "Mistral", dict(sliding_window=8, head_dim=16)),
    "qwen3_moe": ("QWEN3_MoE", "Qwen3Moe", dict(head_dim=32, num_experts=4, num_experts_per_tok=2,
                                                moe_intermediate_size=32, norm_topk_prob=False)),
    "qwen3_moe_renormalized": ("QWEN3_MoE", "Qwen3Moe", dict(num_experts=4, num_experts_per_tok=2,
                                                             moe_intermediate_size=32, norm_topk_prob=True)),
}


def save_hf(path, cls, **kw):
    """A random transformers model of class `cls`, norms and biases away from their initial values (so that a
    mis-mapped one shows), saved to `path`."""
    conf = getattr(transformers, f"{cls}Config")(**{**SHAPE, **kw})
    torch.manual_seed(0)
    hf = getattr(transformers, f"{cls}ForCausalLM")(conf).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith("bias") or n.endswith("gate.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(path)
    return hf


def overrides(keys):
    """`--set` forms of config_from_hf's keys (dotted keys name another section)."""
    return [f"{k if '.' in k else 'model.' + k}={v!r}" for k, v in keys.items()]


def ours_from_hf(path, model_type, attn_backend=None):
    keys = config_from_hf(path, model_type)
    cfg = load_config("configs/tiny.py", [f"model_type={model_type}", f"data.seq_len={T}",
                                          "model.dtype=torch.float32", *overrides(keys)])
    model = build_model(cfg, attn_backend=attn_backend)
    assert set(load_hf(model, path)) >= {n for n, _ in model.named_parameters()}
    return cfg, model.eval(), keys


def max_diff(ours, theirs, ids, **kw):
    with torch.no_grad():
        return (ours(ids, **kw) - theirs(ids).logits).abs().max().item()


@pytest.mark.parametrize("case", list(CASES))
def test_import_and_export_logits_equal_transformers(tmp_path, case):
    model_type, cls, kw = CASES[case]
    hf = save_hf(tmp_path / "hf", cls, **kw)
    cfg, model, keys = ours_from_hf(tmp_path / "hf", model_type)
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    assert max_diff(model, hf, ids) <= 1e-4
    export_hf(tmp_path / "out", cfg, model.state_dict(), tokenizer=None)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(back).__name__ == f"{cls}ForCausalLM"
    assert max_diff(model, back, ids) <= 1e-4
    assert config_from_hf(tmp_path / "out", model_type) == keys  # the exported config.json reads back the same
    if case == "llama3_tied_linear":
        assert model.output.weight is model.tok_embeddings.weight
        assert "lm_head.weight" not in json.loads((tmp_path / "out" / "config.json").read_text())
    if case == "qwen3_moe":
        assert keys["moe.norm_topk_prob"] is False and keys["head_dim"] == 32 and keys["qk_norm"] is True


@pytest.mark.parametrize("backend", ["sdpa", "cpu_blocked"])
def test_sliding_window_holds_in_packed_documents(tmp_path, backend):
    """Two documents in one row (cu_seqlens) with a window of 8 < either length: each document's logits are what
    transformers computes for that document alone."""
    hf = save_hf(tmp_path, "Mistral", sliding_window=8)
    _, model, _ = ours_from_hf(tmp_path, "MISTRAL", attn_backend=backend)
    ids = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(2))
    cut = 20
    pos = torch.cat([torch.arange(cut), torch.arange(T - cut)]).unsqueeze(0)
    with torch.no_grad():
        ours = model(ids, pos, cu_seqlens=torch.tensor([0, cut, T], dtype=torch.int32))
        theirs = torch.cat([hf(ids[:, :cut]).logits, hf(ids[:, cut:]).logits], dim=1)
        assert (ours - theirs).abs().max().item() <= 1e-4
        # without the window the logits past the window differ: the mask is what makes them equal
        model.args.sliding_window = None
        assert (model(ids, pos, cu_seqlens=torch.tensor([0, cut, T], dtype=torch.int32)) - theirs).abs().max() > 1e-3


def test_window_masks_agree_across_kernels():
    seg = torch.tensor([[0] * 11 + [1] * 13])
    dense = _causal_document_mask(seg, window=4)[:, 0]
    assert dense[0, 10].tolist() == [False] * 7 + [True] * 4 + [False] * 13  # keys 7..10 of query 10
    blocks = block_document_masks(seg, block=8, window=4)
    assert torch.equal(torch.cat([torch.nn.functional.pad(~b[:, 0], (0, 24 - b.shape[-1])) for b in blocks], dim=1),
                       dense)
    flash = build_packed_meta(None, 2, 16, "flash", torch.device("cpu"), window=4)
    assert flash.window == 4 and flash.cu_seqlens.tolist() == [0, 16, 32]
    assert build_packed_meta(None, 2, 16, "sdpa", torch.device("cpu"), window=16).mask is None  # no narrower


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 48},
    {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 256},  # within it: unscaled
    {**LLAMA3_ROPE, "original_max_position_embeddings": 64},
])
def test_rotary_tables_equal_transformers_rope_init(scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    length, dim, base = 128, 32, 500000.0
    original = scaling.get("original_max_position_embeddings", length)
    conf = transformers.LlamaConfig(hidden_size=dim * 2, num_attention_heads=2, max_position_embeddings=original,
                                    rope_parameters={**scaling, "rope_theta": base})
    inv_freq, factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](conf, "cpu", seq_len=length)
    assert factor == 1.0
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq.float())
    cos, sin = rotary_tables(dim, length, base, scaling)
    assert torch.allclose(cos, torch.cat((freqs, freqs), -1).cos(), atol=1e-6)
    assert torch.allclose(sin, torch.cat((freqs, freqs), -1).sin(), atol=1e-6)


def tiny(model_type, *extra):
    return load_config("configs/tiny.py", [f"model_type={model_type}", f"data.seq_len={T}", *extra])


def test_counts_follow_the_block_options():
    for cfg in (tiny("QWEN2"), tiny("QWEN3", "model.head_dim=24"), tiny("MISTRAL", "model.sliding_window=8")):
        model = build_model(cfg, "meta")
        assert count_parameters(model) == analytic_parameter_count(model_args(cfg))
    names = dict(build_model(tiny("QWEN2"), "meta").named_parameters())
    assert "layers.0.attention.wq.bias" in names and "layers.0.attention.wo.bias" not in names
    names = dict(build_model(tiny("QWEN3"), "meta").named_parameters())
    assert tuple(names["layers.0.attention.q_norm.weight"].shape) == (model_args(tiny("QWEN3")).head_dim,)


@pytest.mark.parametrize("extra, message", [
    (["model.rope_scaling={'type': 'longrope', 'factor': 2.0}"], "model.rope_scaling: type 'longrope' is not "
                                                                 "implemented"),
    (["model.rope_scaling={'rope_type': 'yarn', 'factor': 2.0}"], "yarn scaling needs original_max_position_embeddings"),
    (["model.rope_scaling={'rope_type': 'llama3', 'factor': 8.0}"], "llama3 scaling needs low_freq_factor > 0"),
    (["model.sliding_window=0"], "model.sliding_window: expected None or an int >= 1"),
    (["model_type=QWEN2", "model.qkv_bias=False"], "model_type QWEN2 has a bias on q, k and v"),
    (["model_type=QWEN3", "model.qk_norm=False"], "model_type QWEN3 normalizes q and k"),
    (["model.head_dim=7"], "model.head_dim: expected an even int >= 2"),
])
def test_config_refuses_what_the_block_cannot_do(extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/tiny.py", ["model_type=LLAMA3", *extra])


def test_hf_configs_the_families_cannot_hold_are_refused(tmp_path):
    save_hf(tmp_path, "Qwen3Moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    c = json.loads((tmp_path / "config.json").read_text())
    for change, message in (({"decoder_sparse_step": "2"}, "expected an int and a list of layer indices"),
                            ({"mlp_only_layers": 1}, "expected an int and a list of layer indices"),
                            ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0}}, "'longrope'")):
        (tmp_path / "config.json").write_text(json.dumps({**c, **change}))
        with pytest.raises(CheckpointError, match=message):
            config_from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**c, "model_type": "qwen2", "architectures": None,
                                                       "use_sliding_window": True, "sliding_window": 8,
                                                       "max_window_layers": 1, "layer_types": None}))
    assert config_from_hf(tmp_path)["window_layers"] == [1]  # the window on layer 1 only (model.window_layers)
    cfg = tiny("LLAMA3", "model.sliding_window=8")
    with pytest.raises(CheckpointError, match="model.sliding_window=8: LlamaForCausalLM has no such option"):
        export_hf(tmp_path / "out", cfg, build_model(cfg).state_dict(), tokenizer=None)


def test_internevo_dynamic_ntk_keys_map_to_rope_scaling():
    cfg = load_config("configs/tiny.py", ["model_type=INTERNLM2", "model.use_dynamic_ntk_rope=True",
                                          "model.rope_scaling_factor=2.0", "model.max_position_embeddings=16"])
    assert cfg.model.rope_scaling == {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16}
    with pytest.raises(ConfigError, match="model.rope_scaling_factor=2.0: InternEvo scales only with"):
        load_config("configs/tiny.py", ["model.rope_scaling_factor=2.0"])


def test_import_refuses_a_model_whose_block_options_differ(tmp_path):
    save_hf(tmp_path, "Llama", rope_parameters=LLAMA3_ROPE)
    keys = {k: v for k, v in config_from_hf(tmp_path, "LLAMA3").items() if k != "rope_scaling"}
    model = build_model(load_config("configs/tiny.py", ["model_type=LLAMA3", f"data.seq_len={T}", *overrides(keys),
                                                        "model.rope_scaling={'type': 'linear', 'factor': 8.0}"]))
    with pytest.raises(CheckpointError, match=r"rope_parameters=\{'rope_type': 'llama3'.* vs model.rope_scaling="
                                              r"\{'type': 'linear', 'factor': 8.0\}"):
        load_hf(model, tmp_path)
    same = dict(LLAMA3_ROPE, rope_type="llama3")  # transformers' spelling with rope_theta: the same scaling
    model = build_model(load_config("configs/tiny.py", ["model_type=LLAMA3", f"data.seq_len={T}", *overrides(keys),
                                                        f"model.rope_scaling={same!r}"]))
    assert load_hf(model, tmp_path)
