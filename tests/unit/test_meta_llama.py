"""Meta's original Llama folders (ckpt_type "llama", InternEvo's "LLAMA"): params.json + consolidated.NN.pth.

The test writes the folder itself from Meta's published layout (llama/model.py: fairscale's ColumnParallelLinear
splits wq/wk/wv/w1/w3/output by rows, RowParallelLinear wo/w2 by columns, Llama 2's ParallelEmbedding the hidden
size and Llama 3's VocabParallelEmbedding the vocabulary; norms are replicated) and converts the same weights to a
transformers LlamaForCausalLM with the permutation of transformers' convert_llama_weights_to_hf. Our model loaded
from the Meta folder must give the logits of that HF model.
"""

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from internlm_core.checkpoint.pth_shards import config_from_pth_folder, load_pth_folder  # noqa: E402
from internlm_core.config import load_config  # noqa: E402
from internlm_core.errors import CheckpointError  # noqa: E402
from internlm_core.model import AdapterContext, build_model  # noqa: E402
from internlm_core.model.llama.meta import from_meta, to_halves, to_meta, to_pairs  # noqa: E402
from tests.helpers.meta_llama import LLAMA2, LLAMA3, VOCAB, meta_weights, write_meta_folder  # noqa: E402


def hf_from_meta(p: dict, full: dict):
    """A LlamaForCausalLM holding the same weights, converted as transformers' convert_llama_weights_to_hf does."""
    d, h = p["dim"], p["n_heads"]
    kv = p.get("n_kv_heads") or h

    def permute(w, heads):  # Meta's interleaved rotary pairs -> HF's rotate-half rows
        return w.view(heads, w.shape[0] // heads // 2, 2, d).transpose(1, 2).reshape(w.shape[0], d)

    ffn = full["layers.0.feed_forward.w1.weight"].shape[0]
    conf = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=d, intermediate_size=ffn,
                                    num_hidden_layers=p["n_layers"], num_attention_heads=h, num_key_value_heads=kv,
                                    rms_norm_eps=p["norm_eps"], rope_theta=p.get("rope_theta", 10000.0),
                                    max_position_embeddings=64, tie_word_embeddings=False)
    sd = {"model.embed_tokens.weight": full["tok_embeddings.weight"], "model.norm.weight": full["norm.weight"],
          "lm_head.weight": full["output.weight"]}
    for i in range(p["n_layers"]):
        m, a = f"model.layers.{i}.", f"layers.{i}."
        sd.update({m + "self_attn.q_proj.weight": permute(full[a + "attention.wq.weight"], h),
                   m + "self_attn.k_proj.weight": permute(full[a + "attention.wk.weight"], kv),
                   m + "self_attn.v_proj.weight": full[a + "attention.wv.weight"],
                   m + "self_attn.o_proj.weight": full[a + "attention.wo.weight"],
                   m + "mlp.gate_proj.weight": full[a + "feed_forward.w1.weight"],
                   m + "mlp.down_proj.weight": full[a + "feed_forward.w2.weight"],
                   m + "mlp.up_proj.weight": full[a + "feed_forward.w3.weight"],
                   m + "input_layernorm.weight": full[a + "attention_norm.weight"],
                   m + "post_attention_layernorm.weight": full[a + "ffn_norm.weight"]})
    hf = transformers.LlamaForCausalLM(conf).eval()
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return hf


def our_llama(folder, *extra):
    keys = config_from_pth_folder(folder)
    sets = [f"model.{k}={v}" for k, v in keys.items()]
    if "vocab_size" not in keys:
        sets.append(f"model.vocab_size={VOCAB}")
    cfg = load_config("configs/tiny.py", ["model_type=LLAMA", "data.seq_len=64", "model.dtype=torch.float32", *sets,
                                          *extra])
    return build_model(cfg).eval(), keys


@pytest.mark.parametrize("params, embed_dim", [(LLAMA2, 1), (LLAMA3, 0)], ids=["llama2", "llama3"])
def test_meta_folder_gives_the_logits_of_the_transformers_conversion(tmp_path, params, embed_dim):
    full = meta_weights(params)
    write_meta_folder(tmp_path, params, full, mp=2, embed_dim=embed_dim)
    model, keys = our_llama(tmp_path)
    assert keys["num_kv_attention_heads"] == (params.get("n_kv_heads") or params["n_heads"])
    assert keys["intermediate_size"] == full["layers.0.feed_forward.w1.weight"].shape[0]
    assert keys["rope_base"] == params.get("rope_theta", 10000.0)
    loaded = load_pth_folder(model, tmp_path)
    assert sorted(loaded) == sorted(model.state_dict())
    hf = hf_from_meta(params, full)
    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert theirs.abs().max().item() > 0.1  # not a degenerate comparison
    # the embedding as one tensor, the FFN's up and down projections swapped into our names
    assert torch.equal(model.state_dict()["tok_embeddings.weight"], full["tok_embeddings.weight"])
    assert torch.equal(model.state_dict()["layers.1.feed_forward.w2.weight"], full["layers.1.feed_forward.w3.weight"])


def test_adapter_round_trip_and_rotary_permutation():
    cfg = load_config("configs/tiny.py", ["model_type=LLAMA", "model.num_kv_attention_heads=2", "data.seq_len=64"])
    model = build_model(cfg)
    sd = {k: torch.randn(v.shape) for k, v in model.state_dict().items()}
    for embed_dim in (0, 1):
        ctx = AdapterContext(args=model.args, tp=2, options={"embed_dim": embed_dim})
        shards = to_meta(sd, ctx)
        assert shards[0]["tok_embeddings.weight"].shape[embed_dim] * 2 == sd["tok_embeddings.weight"].shape[embed_dim]
        assert torch.equal(shards[1]["layers.0.feed_forward.w3.weight"],  # our up projection is Meta's w3
                           torch.chunk(sd["layers.0.feed_forward.w2.weight"], 2, dim=0)[1])
        back = from_meta(shards, AdapterContext(args=model.args, tp=2))
        assert sorted(back) == sorted(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    x = torch.arange(16.0).reshape(8, 2)  # one head of head_dim 8: rows (0, 1), (2, 3), ... are rotary pairs
    assert to_halves(x, 8)[:, 0].tolist() == [0, 4, 8, 12, 2, 6, 10, 14]
    assert torch.equal(to_pairs(to_halves(x, 8), 8), x)


def test_refusals_name_the_file_and_what_was_expected(tmp_path):
    full = meta_weights(LLAMA3)
    write_meta_folder(tmp_path / "a", LLAMA3, full, mp=2, embed_dim=0)
    model, _ = our_llama(tmp_path / "a", "model.rope_base=10000.0")
    with pytest.raises(CheckpointError, match=r"the model does not match the folder's params.json \(rope_base: "
                                              r"model 10000.0 vs .*params.json 500000.0\)"):
        load_pth_folder(model, tmp_path / "a")
    internlm = build_model(load_config("configs/tiny.py", ["model_type=INTERNLM"]))
    with pytest.raises(CheckpointError, match="ckpt_type llama: model_type INTERNLM has no llama checkpoint adapter"):
        load_pth_folder(internlm, tmp_path / "a", "INTERNLM")
    scaled = dict(LLAMA3, use_scaled_rope=True)
    (tmp_path / "a" / "params.json").write_text(json.dumps(scaled))
    with pytest.raises(CheckpointError, match=r"params.json: use_scaled_rope=true .* not implemented"):
        config_from_pth_folder(tmp_path / "a")
    # a shard that is not plain data is refused by torch.load(weights_only=True), the file named
    write_meta_folder(tmp_path / "b", LLAMA3, full, mp=2, embed_dim=0)
    torch.save({"x": torch.ones(1), "code": torch.nn.Linear(1, 1)}, tmp_path / "b" / "consolidated.01.pth")
    model, _ = our_llama(tmp_path / "b")
    with pytest.raises(CheckpointError, match=r"consolidated.01.pth: not a plain tensor file, refused by "
                                              r"torch.load\(weights_only=True\)"):
        load_pth_folder(model, tmp_path / "b")
    write_meta_folder(tmp_path / "c", LLAMA3, full, mp=2, embed_dim=0)
    shard = torch.load(tmp_path / "c" / "consolidated.01.pth", weights_only=True)
    del shard["layers.1.ffn_norm.weight"]
    torch.save(shard, tmp_path / "c" / "consolidated.01.pth")
    with pytest.raises(CheckpointError, match="'layers.1.ffn_norm.weight' is in shard 0 but not in shard 1"):
        load_pth_folder(model, tmp_path / "c")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "params.json").write_text(json.dumps(LLAMA3))
    with pytest.raises(CheckpointError, match="no consolidated.NN.pth \\(or other .pth\\) files"):
        load_pth_folder(model, tmp_path / "d")


def test_internevo_spellings_of_the_type():
    from internlm_core.checkpoint import FOREIGN_LOADERS
    for spelling, kind in (("LLAMA", "llama"), ("llama", "llama"), ("meta", "llama"), ("internlm2_test", "internlm"),
                           ("internevo", "internlm"), ("hf_model", "hf")):
        cfg = load_config("configs/tiny.py", [f"ckpt.load_ckpt_info={{'path': '/x', 'content': ('model',), "
                                              f"'ckpt_type': '{spelling}'}}"])
        assert cfg.ckpt.load_ckpt_info.ckpt_type == kind
    assert FOREIGN_LOADERS["llama"] is load_pth_folder


def test_hf_pytorch_model_bin_loads_as_safetensors_do(tmp_path):
    """InternEvo's hf_llama reads pytorch_model*.bin: read here through torch.load(weights_only=True) only."""
    from internlm_core.checkpoint.hf import config_from_hf, load_hf

    conf = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(5)
    hf = transformers.LlamaForCausalLM(conf).eval()
    hf.save_pretrained(tmp_path / "st")
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    (tmp_path / "bin").mkdir()
    (tmp_path / "st" / "config.json").rename(tmp_path / "bin" / "config.json")
    torch.save(sd, tmp_path / "bin" / "pytorch_model.bin")
    keys = config_from_hf(tmp_path / "bin")
    cfg = load_config("configs/tiny.py", ["model_type=LLAMA", "data.seq_len=64", "model.dtype=torch.float32",
                                          *[f"model.{k}={v}" for k, v in keys.items()]])
    a, b = build_model(cfg), build_model(cfg)
    (tmp_path / "st" / "config.json").write_text((tmp_path / "bin" / "config.json").read_text())
    load_hf(a, tmp_path / "st")
    assert sorted(load_hf(b, tmp_path / "bin")) == sorted(b.state_dict())
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    torch.save({**sd, "evil": torch.nn.Linear(1, 1)}, tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin: not a plain tensor file, refused by "
                                              r"torch.load\(weights_only=True\)"):
        load_hf(b, tmp_path / "bin")
