"""Hugging Face Llama interchange against transformers itself: export (logits), import (loss), config, tokenizers.

Tiny random models only; transformers never touches the network (HF_HUB_OFFLINE).
"""

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from internlm_core.checkpoint.hf import config_from_hf, export_hf, load_hf_llama  # noqa: E402
from internlm_core.model import AdapterContext  # noqa: E402
from internlm_core.model.internlm.hf import (llama_from_hf as from_hf, llama_to_hf as to_hf,  # noqa: E402
                                             llama_to_ours_name as hf_to_ours_name,
                                             ours_to_llama_name as ours_to_hf_name)
from internlm_core.checkpoint.safetensors_io import parse_size, plan_shards  # noqa: E402
from internlm_core.checkpoint.tokenizer_export import write_tokenizer_files  # noqa: E402
from internlm_core.config import load_config  # noqa: E402
from internlm_core.data.tokenizers import load_tokenizer  # noqa: E402
from internlm_core.errors import CheckpointError  # noqa: E402
from internlm_core.loss import FlashGPTLMLoss  # noqa: E402
from internlm_core.model import build_model  # noqa: E402

from tests.helpers.fixtures import INTERNLM_FIXTURES  # noqa: E402

V7 = str(INTERNLM_FIXTURES / "V7_sft.model")


def tiny_cfg(model_type="INTERNLM", *extra):
    return load_config("configs/tiny.py", [f"model_type={model_type}", "model.vocab_size=300", "data.seq_len=64",
                                           "model.dtype=torch.float32", *extra])


def random_model(cfg, seed=0):
    """Our model with every tensor random (biases and norms too, so a mis-mapped tensor shows)."""
    torch.manual_seed(seed)
    m = build_model(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m.eval()


def hf_load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# ---- names -----------------------------------------------------------------------------------------------

def tied(tie: bool) -> AdapterContext:
    class Args:
        tie_word_embeddings = tie
    return AdapterContext(Args())


def test_names_map_one_to_one_both_ways():
    names = list(build_model(tiny_cfg("INTERNLM", "model.num_layers=3"), "meta").state_dict())
    hf = [ours_to_hf_name(n) for n in names]
    assert len(set(hf)) == len(names) == 1 + 3 * (9 + 4) + 2
    assert [hf_to_ours_name(h) for h in hf] == names
    assert ours_to_hf_name("layers.2.feed_forward.w1.weight") == "model.layers.2.mlp.gate_proj.weight"
    assert ours_to_hf_name("layers.2.feed_forward.w2.weight") == "model.layers.2.mlp.up_proj.weight"
    assert ours_to_hf_name("layers.2.feed_forward.w3.weight") == "model.layers.2.mlp.down_proj.weight"
    assert ours_to_hf_name("layers.0.attention.wo.bias") == "model.layers.0.self_attn.o_proj.bias"
    assert ours_to_hf_name("layers.1.ffn_norm.weight") == "model.layers.1.post_attention_layernorm.weight"
    with pytest.raises(CheckpointError, match="'layers.0.attention.rope.weight' has no Hugging Face"):
        ours_to_hf_name("layers.0.attention.rope.weight")
    with pytest.raises(CheckpointError, match="'model.layers.0.mlp.fc1.weight' has no counterpart"):
        hf_to_ours_name("model.layers.0.mlp.fc1.weight")


def test_tied_output_is_dropped_on_export_and_restored_on_import():
    e = torch.ones(4, 2)
    hf = to_hf({"tok_embeddings.weight": e, "output.weight": e, "norm.weight": torch.ones(2)}, tied(True))
    assert sorted(hf) == ["model.embed_tokens.weight", "model.norm.weight"]
    back = from_hf(hf, tied(True))
    assert back["output.weight"] is e
    assert list(to_hf({"output.weight": e}, tied(True))) == ["model.embed_tokens.weight"]  # a last pipeline stage


def test_sizes_and_shard_plan():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(1000) == 1000
    with pytest.raises(CheckpointError, match="max shard size '5 gigs'"):
        parse_size("5 gigs")
    assert plan_shards([("a", 6), ("b", 5), ("c", 20), ("d", 1)], 10) == [["a"], ["b"], ["c"], ["d"]]
    assert plan_shards([("a", 3), ("b", 3), ("c", 3), ("d", 3)], 10) == [["a", "b", "c"], ["d"]]


# ---- export ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type,extra", [
    ("INTERNLM", []),  # v1: bias on q/k/v/o
    ("LLAMA", ["model.num_kv_attention_heads=2", "model.rope_base=500000.0"]),  # GQA
    ("INTERNLM2", ["model.num_kv_attention_heads=1", "model.tie_word_embeddings=True", "model.layer_norm_epsilon=1e-6"]),
])
def test_export_logits_equal_transformers(tmp_path, model_type, extra):
    cfg = tiny_cfg(model_type, *extra)
    model = random_model(cfg)
    files = export_hf(tmp_path, cfg, model.state_dict(), max_shard_size="200KB", tokenizer=None)
    names = {f.name for f in files}
    assert "model.safetensors.index.json" in names and "config.json" in names
    shards = sorted(n for n in names if n.startswith("model-"))
    assert len(shards) > 1 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert len(index["weight_map"]) == len(to_hf(model.state_dict(), tied(cfg.model.tie_word_embeddings)))

    hf = hf_load(tmp_path)
    assert type(hf).__name__ == "LlamaForCausalLM"
    torch.manual_seed(1)
    ids = torch.randint(0, 300, (2, 48))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_export_config_json(tmp_path):
    cfg = tiny_cfg("LLAMA", "model.num_kv_attention_heads=2", "model.rope_base=250000.0", "model.multiple_of=32",
                   "model.mlp_ratio=2.5")
    export_hf(tmp_path, cfg, random_model(cfg).state_dict(), tokenizer=None)
    c = json.loads((tmp_path / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama"
    assert (c["num_key_value_heads"], c["num_attention_heads"], c["hidden_size"]) == (2, 4, 128)
    assert c["intermediate_size"] == 320  # 128 * 2.5 rounded up to a multiple of 32
    assert c["rope_theta"] == 250000.0 and c["rope_parameters"] == {"rope_type": "default", "rope_theta": 250000.0}
    assert c["attention_bias"] is False and c["tie_word_embeddings"] is False and c["torch_dtype"] == "float32"
    assert c["max_position_embeddings"] == 64
    assert (tmp_path / "model.safetensors").is_file()  # one shard: no index
    assert not (tmp_path / "model.safetensors.index.json").exists()
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    assert hf_cfg.num_key_value_heads == 2 and hf_cfg.intermediate_size == 320


def test_export_bf16_by_default_for_bf16_runs(tmp_path):
    from safetensors import safe_open

    cfg = tiny_cfg("INTERNLM", "model.dtype=torch.bfloat16")
    model = random_model(cfg)
    export_hf(tmp_path, cfg, model.state_dict(), tokenizer=None)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        t = f.get_tensor("model.layers.0.self_attn.o_proj.bias")
    assert t.dtype == torch.bfloat16
    assert torch.equal(t, model.state_dict()["layers.0.attention.wo.bias"].to(torch.bfloat16))


def test_export_refuses_post_norm_and_bad_state(tmp_path):
    cfg = tiny_cfg("INTERNLM", "model.apply_post_layer_norm=True")
    with pytest.raises(CheckpointError, match="post-norm blocks have no Hugging Face equivalent"):
        export_hf(tmp_path / "a", cfg, random_model(cfg).state_dict(), tokenizer=None)
    cfg = tiny_cfg("INTERNLM")
    sd = dict(random_model(cfg).state_dict())
    sd["layers.1.feed_forward.w1.weight"] = torch.zeros(3, 3)
    with pytest.raises(CheckpointError, match=r"layers.1.feed_forward.w1.weight has shape \(3, 3\), the config's "
                                              r"model expects \(384, 128\)"):
        export_hf(tmp_path / "b", cfg, sd, tokenizer=None)
    del sd["norm.weight"]
    with pytest.raises(CheckpointError, match=r"state dict lacks 1 parameter\(s\), e.g. \['norm.weight'\]"):
        export_hf(tmp_path / "c", cfg, sd, tokenizer=None)


# ---- import ----------------------------------------------------------------------------------------------

def write_hf_llama(path, **kw):
    """A random LlamaForCausalLM saved by transformers itself."""
    conf = dict(vocab_size=320, hidden_size=96, intermediate_size=200, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=100000.0,
                tie_word_embeddings=False, attention_bias=False)
    conf.update(kw)
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**conf)).eval()
    with torch.no_grad():  # HF's init leaves norms at 1 and biases at 0: make them count
        for n, p in hf.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(path, max_shard_size="100KB")
    return hf


def our_model_from_hf(path, model_type="LLAMA"):
    keys = config_from_hf(path)
    cfg = load_config("configs/tiny.py", [f"model_type={model_type}", "data.seq_len=64", "model.dtype=torch.float32",
                                          *[f"model.{k}={v}" for k, v in keys.items()]])
    return build_model(cfg), keys


@pytest.mark.parametrize("kw", [dict(), dict(attention_bias=True, tie_word_embeddings=True, num_key_value_heads=6)])
def test_import_loss_equals_transformers(tmp_path, kw):
    hf = write_hf_llama(tmp_path, **kw)
    assert (tmp_path / "model.safetensors.index.json").is_file()  # sharded by transformers
    model, keys = our_model_from_hf(tmp_path)
    assert keys["rope_base"] == 100000.0 and keys["num_kv_attention_heads"] == hf.config.num_key_value_heads
    assert keys["qkv_bias"] == kw.get("attention_bias", False)
    loaded = load_hf_llama(model, tmp_path)
    assert set(loaded) == set(model.state_dict())
    torch.manual_seed(4)
    ids = torch.randint(0, 320, (2, 64))
    model.eval()
    with torch.no_grad():
        theirs = hf(ids, labels=ids).loss.item()
        ours = FlashGPTLMLoss(use_flash=False)(model(ids)[:, :-1], ids[:, 1:])[0].item()
    assert abs(ours - theirs) <= 1e-5, (ours, theirs)
    assert ours > 5.0  # a random model on 320 tokens: about ln(320) = 5.77, not a degenerate value


def test_import_checks_config_and_missing_tensors(tmp_path):
    write_hf_llama(tmp_path)
    keys = config_from_hf(tmp_path)
    sets = [f"model.{k}={v}" for k, v in keys.items() if k != "num_layers"]
    model = build_model(load_config("configs/tiny.py", ["model_type=LLAMA", "data.seq_len=64", "model.num_layers=3",
                                                        *sets]))
    with pytest.raises(CheckpointError, match=r"config.json: the model differs from the folder's config.json: "
                                              r"num_hidden_layers=2 vs model.num_layers=3 \(build it from"):
        load_hf_llama(model, tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    index.write_text(json.dumps(data))
    model, _ = our_model_from_hf(tmp_path)
    with pytest.raises(CheckpointError, match="missing 1 tensor\\(s\\) the model needs, e.g. "
                                              "model.layers.1.mlp.up_proj.weight"):
        load_hf_llama(model, tmp_path)


def test_config_from_hf_refuses_what_we_do_not_implement(tmp_path):
    write_hf_llama(tmp_path)
    c = json.loads((tmp_path / "config.json").read_text())
    for change, message in [
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 5e5, "factor": 8.0}},
         "rope scaling 'longrope' .* is not implemented"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
         "llama3 rope scaling without low_freq_factor, high_freq_factor"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"model_type": "mistral"}, "model_type 'mistral' \\(LlamaForCausalLM\\); internlm-core reads"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({**c, **change}))
        with pytest.raises(CheckpointError, match=message):
            config_from_hf(tmp_path)


# ---- tokenizer files -------------------------------------------------------------------------------------

TEXTS = ["Hello world, this is a test.", "def f(x):\n    return x  # two  spaces", "中文字符 ok", "naïve café"]


def test_byte_tokenizer_exports_as_tokenizer_json(tmp_path):
    exp = write_tokenizer_files("byte", tmp_path, 256)
    assert exp.special_ids == {"bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258}
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS + [" leading space", "\n\n"]:
        ids = tok(text)["input_ids"]
        assert ids == [256] + list(text.encode("utf-8"))
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.eos_token_id == 257 and tok.pad_token_id == 258


def test_sentencepiece_without_dummy_prefix_matches_exactly(tmp_path):
    exp = write_tokenizer_files(V7, tmp_path, 2048)
    assert (tmp_path / "tokenizer.model").read_bytes() == open(V7, "rb").read()
    assert exp.special_ids["bos_token_id"] == 1 and exp.special_ids["eos_token_id"] == 2
    ours = load_tokenizer(V7)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS + [" leading space", "a  b   c\t\td"]:
        assert tok(text)["input_ids"] == [1] + ours.encode(text), text


def test_sentencepiece_with_dummy_prefix(tmp_path):
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["the quick brown fox jumps over the lazy dog", "hello world, hello tests",
                                 "def f(x): return x * 2", "naïve café 中文字符"] * 50))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=400,
                                   model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, minloglevel=2)
    out = tmp_path / "hf"
    out.mkdir()
    exp = write_tokenizer_files(str(tmp_path / "sp.model"), out, 128)
    assert "add_prefix_space=True" in exp.note and "WARNING" not in exp.note
    ours = load_tokenizer(str(tmp_path / "sp.model"))
    tok = transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS:  # (text starting with a space differs: transformers' Metaspace does not prepend then)
        assert tok(text)["input_ids"] == [ours.bos_id] + ours.encode(text), text


def test_unknown_tokenizer_writes_nothing_and_says_so(tmp_path):
    exp = write_tokenizer_files(None, tmp_path, 128)
    assert exp.files == [] and "no tokenizer files written" in exp.note
    with pytest.raises(CheckpointError, match="tokenizer '/nonexistent/tok.model'"):
        write_tokenizer_files("/nonexistent/tok.model", tmp_path, 128)
