"""No silent mismatch between a Hugging Face folder and the model it loads into (issue 36): a built model whose keys
differ from config.json is refused in one line naming both sides (numerics and routing included); a run's config
takes the folder's values where it left them at their defaults, refuses an explicit other value unless
ckpt.load_ckpt_info.keep_run_keys names it; tensors nothing reads are refused; Mixtral's head_dim exports; Qwen's
window keys are read as transformers applies them. Tiny random transformers models, fp32, offline."""

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from internlm_core.checkpoint.hf import config_from_hf, export_hf, load_hf  # noqa: E402
from internlm_core.config import load_config  # noqa: E402
from internlm_core.config.loader import compat_lines  # noqa: E402
from internlm_core.config.schema import ModelConfig, MoEConfig  # noqa: E402
from internlm_core.errors import CheckpointError, ConfigError  # noqa: E402
from internlm_core.model import build_model  # noqa: E402

T, V = 32, 320
SHAPE = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=T)
MOE = dict(num_experts_per_tok=2, tie_word_embeddings=False)


def save_hf(path, cls, **kw):
    """A random transformers model of class `cls`, norms moved off 1, saved to `path`."""
    conf = getattr(transformers, f"{cls}Config")(**{**SHAPE, **kw})
    torch.manual_seed(0)
    hf = getattr(transformers, f"{cls}ForCausalLM")(conf).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(path)
    return hf


def sets(keys, leave=()):
    """--set forms of config_from_hf's keys but those in `leave` (left at the config's defaults)."""
    return [f"{k if '.' in k else 'model.' + k}={v!r}" for k, v in keys.items() if k not in leave]


def ours(path, model_type, leave=(), extra=(), family=True):
    """Our model built from the folder's keys but `leave` (read by `model_type`'s adapter, or any's)."""
    keys = config_from_hf(path, model_type if family else None)
    cfg = load_config("configs/tiny.py", [f"model_type={model_type}", f"data.seq_len={T}",
                                          "model.dtype=torch.float32", *sets(keys, leave), *extra])
    return cfg, build_model(cfg)


def diff(model, hf):
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (model.eval()(ids) - hf(ids).logits).abs().max().item()


def refusal(fn):
    """The one line of the CheckpointError / ConfigError fn raises."""
    with pytest.raises((CheckpointError, ConfigError)) as e:
        fn()
    text = str(e.value)
    assert "\n" not in text
    return text


# (folder class, its config beyond SHAPE, our family, the key left at our default, the expected words)
SILENT_BEFORE = {
    "rope_theta": ("Llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 5e5}), "LLAMA", "rope_base",
                   "rope_parameters.rope_theta=500000.0 vs model.rope_base=10000.0"),
    "rms_norm_eps": ("Llama", dict(rms_norm_eps=1e-6), "LLAMA", "layer_norm_epsilon",
                     "rms_norm_eps=1e-06 vs model.layer_norm_epsilon=1e-05"),
    "mixtral_top1": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=1), "MIXTRAL", "top_k",
                     "num_experts_per_tok=1 vs moe.top_k=2"),
    "qwen3_moe_norm": ("Qwen3Moe", dict(MOE, num_experts=4, moe_intermediate_size=32, norm_topk_prob=False),
                       "QWEN3_MoE", "moe.norm_topk_prob", "norm_topk_prob=False vs moe.norm_topk_prob=True"),
}


@pytest.mark.parametrize("case", list(SILENT_BEFORE))
def test_python_api_refuses_a_model_with_other_numbers(tmp_path, case):
    cls, kw, model_type, left, words = SILENT_BEFORE[case]
    hf = save_hf(tmp_path, cls, **kw)
    _, model = ours(tmp_path, model_type, leave=(left,))
    line = refusal(lambda: load_hf(model, tmp_path))
    assert line == (f"{tmp_path}/config.json: the model differs from the folder's config.json: {words} (build it "
                    f"from internlm_core.checkpoint.hf.config_from_hf, or name the key in "
                    f"ckpt.load_ckpt_info.keep_run_keys)")
    _, model = ours(tmp_path, model_type)  # the folder's value: loads, transformers' logits
    load_hf(model, tmp_path)
    assert diff(model, hf) <= 1e-4


def run_config(path, model_type, keys, leave=(), extra=()):
    info = {"path": str(path), "content": ["model"], "ckpt_type": "hf"}
    return load_config("configs/tiny.py", [f"model_type={model_type}", f"data.seq_len={T}", "ckpt.auto_resume=False",
                                           f"ckpt.load_ckpt_info={info!r}", *sets(keys, leave), *extra])


@pytest.mark.parametrize("case", list(SILENT_BEFORE))
def test_run_config_takes_the_folders_values_refuses_other_explicit_ones(tmp_path, case):
    cls, kw, model_type, left, words = SILENT_BEFORE[case]
    save_hf(tmp_path, cls, **kw)
    keys = config_from_hf(tmp_path, model_type)
    dotted = left if "." in left else ("moe.top_k" if left == "top_k" else f"model.{left}")
    section, name = dotted.split(".")
    ours_default = getattr({"model": ModelConfig, "moe": MoEConfig}[section](), name)  # the schema's default
    # left at its default: the folder's value, said once
    cfg = run_config(tmp_path, model_type, keys, leave=(left,))
    assert getattr(getattr(cfg, section), name) == keys[left]
    assert any(f"{dotted}={keys[left]!r}" in line for line in compat_lines(cfg))
    # set explicitly to another value: refused, one line naming both
    line = refusal(lambda: run_config(tmp_path, model_type, keys, leave=(left,),
                                      extra=(f"{dotted}={ours_default!r}",)))
    assert f"config.json defines the model it holds, the config sets otherwise: {words} (drop these keys" in line
    # on purpose: kept, and the load compares every other key
    cfg = run_config(tmp_path, model_type, keys, leave=(left,),
                     extra=(f"{dotted}={ours_default!r}", f"ckpt.load_ckpt_info.keep_run_keys=[{dotted!r}]"))
    assert getattr(getattr(cfg, section), name) == ours_default
    assert load_hf(build_model(cfg), tmp_path, keep=(dotted,))


def test_keep_run_keys_must_name_a_key_of_the_folder(tmp_path):
    save_hf(tmp_path, "Llama")
    line = refusal(lambda: run_config(tmp_path, "LLAMA", config_from_hf(tmp_path),
                                      extra=("ckpt.load_ckpt_info.keep_run_keys=['model.rope_bse']",)))
    assert "ckpt.load_ckpt_info.keep_run_keys: model.rope_bse not among the keys" in line


def test_tensors_nothing_reads_are_refused(tmp_path):
    save_hf(tmp_path, "Llama", attention_bias=True)  # bias on q, k, v and o_proj; QWEN2 has none on o
    _, model = ours(tmp_path, "QWEN2", family=False)  # the Llama adapter reads it, as load_hf(model, path) does
    line = refusal(lambda: load_hf(model, tmp_path))
    assert line == (f"{tmp_path}: 2 tensor(s) of the folder that nothing in the built model reads: "
                    "model.layers.0.self_attn.o_proj.bias, model.layers.1.self_attn.o_proj.bias (loading without "
                    "them gives another model than the folder's)")


def test_mixtral_router_jitter_noise_is_refused(tmp_path):
    save_hf(tmp_path, "Mixtral", num_local_experts=4, router_jitter_noise=0.1)
    line = refusal(lambda: config_from_hf(tmp_path))
    assert line.startswith(f"{tmp_path}/config.json: router_jitter_noise=0.1: Mixtral's jitter scales the experts' "
                           "input too")


def test_mixtral_with_its_own_head_dim_both_ways(tmp_path):
    hf = save_hf(tmp_path / "in", "Mixtral", num_local_experts=4, head_dim=32)
    cfg, model = ours(tmp_path / "in", "MIXTRAL")
    assert cfg.model.head_dim == 32
    load_hf(model, tmp_path / "in")
    assert diff(model, hf) <= 1e-4
    export_hf(tmp_path / "out", cfg, model.state_dict(), tokenizer=None)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["head_dim"] == 32
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert diff(model, theirs) <= 1e-4


@pytest.mark.parametrize("cls,model_type,kw,window", [
    ("Qwen3", "QWEN3", dict(max_window_layers=2), None),  # max_window_layers >= layers: no layer slides
    ("Qwen3", "QWEN3", dict(max_window_layers=5), None),
    ("Qwen3Moe", "QWEN3_MoE", dict(MOE, num_experts=4, moe_intermediate_size=32, max_window_layers=1), 8),
])
def test_qwen_windows_as_transformers_applies_them(tmp_path, cls, model_type, kw, window):
    hf = save_hf(tmp_path / "in", cls, use_sliding_window=True, sliding_window=8, **kw)
    assert config_from_hf(tmp_path / "in")["sliding_window"] == window
    cfg, model = ours(tmp_path / "in", model_type)
    load_hf(model, tmp_path / "in")
    assert diff(model, hf) <= 1e-4  # 32 tokens: an 8-token window shows
    export_hf(tmp_path / "out", cfg, model.state_dict(), tokenizer=None)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert diff(model, theirs) <= 1e-4


def test_a_window_on_some_layers_is_refused_where_the_class_cannot_hold_it(tmp_path):
    save_hf(tmp_path, "Qwen3Moe", **MOE, num_experts=4, moe_intermediate_size=32)
    cfg, model = ours(tmp_path, "QWEN3_MoE", extra=("model.sliding_window=8", "model.window_layers=[1]"))
    line = refusal(lambda: export_hf(tmp_path / "out", cfg, model.state_dict(), tokenizer=None))
    assert line.startswith("model.window_layers=[1]: Qwen3MoeForCausalLM has no such option")


@pytest.mark.parametrize("cls,model_type,kw", [
    ("Mixtral", "MIXTRAL", dict(num_local_experts=4)),  # MixtralConfig: rms_norm_eps 1e-5, rope_theta 1e6
    ("Mistral", "MISTRAL", dict(sliding_window=8)),  # MistralConfig: sliding_window 4096
    ("Qwen2", "QWEN2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0)),  # Qwen2Config: 4096
    ("Qwen3Moe", "QWEN3_MoE", dict(MOE, num_experts=4, moe_intermediate_size=32, use_sliding_window=True)),
])
def test_keys_config_json_leaves_out_are_the_classes_defaults(tmp_path, cls, model_type, kw):
    """A config.json without rms_norm_eps / rope_theta / sliding_window means what transformers' class defaults
    to, not Llama's (a Mixtral folder without them loaded with eps 1e-6 and theta 1e4: logits off by 0.2)."""
    save_hf(tmp_path, cls, **kw)
    conf = json.loads((tmp_path / "config.json").read_text())
    for key in ("rms_norm_eps", "rope_parameters", "rope_theta", "sliding_window"):
        conf.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(conf))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    keys = config_from_hf(tmp_path)
    assert (keys["layer_norm_epsilon"], keys["rope_base"], keys["sliding_window"]) == \
        (hf.config.rms_norm_eps, hf.config.rope_parameters["rope_theta"], hf.config.sliding_window)
    _, model = ours(tmp_path, model_type)
    load_hf(model, tmp_path)
    assert diff(model, hf) <= 1e-4


def test_run_config_refuses_a_folder_of_another_class(tmp_path):
    """A run whose model_type does not read the folder's class is refused when the config is loaded (before: the
    family's default shape was built and estimated first, so the run stopped on a memory error, or loaded nothing
    of the folder's config)."""
    save_hf(tmp_path, "Qwen2")
    line = refusal(lambda: run_config(tmp_path, "LLAMA", {}))
    assert line.endswith(f"ckpt.load_ckpt_info.path: {tmp_path}/config.json holds a Qwen2ForCausalLM; model_type "
                         "LLAMA reads LlamaForCausalLM (set the model_type of the folder's class)")
