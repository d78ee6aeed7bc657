"""InternLM's and InternEvo's weights in and out, each mapping checked against a reference we did not derive from
our own mapping code:

- InternLM folders written by our tool are merged and renamed by InternLM's tools/transformers/convert2hf.py rules
  (written out below from InternLM at aaaf4d7: load model_tp*_pp*.pt, shift pipeline layers, merge tensor shards,
  rename to HF names) and the resulting HF tensors run through the HF InternLM modelling math written out here;
- Hugging Face InternLM v1 / InternLM2 folders (their modelling code is remote code, not installed) are written by
  hand from random tensors and their logits computed by that math; ours must agree within 1e-4 in fp32.
"""

import json
import math
import os
import re

import pytest
import torch
import torch.nn.functional as F

from internlm_core.checkpoint.hf import config_from_hf, export_hf, load_hf
from internlm_core.checkpoint.internlm_format import load_internlm, read_internlm_folder, write_internlm_folder
from internlm_core.checkpoint.safetensors_io import read_hf_tensors
from internlm_core.config import load_config
from internlm_core.errors import CheckpointError
from internlm_core.model import build_model

TOL = 1e-4


def tiny(model_type="INTERNLM", *extra):
    return load_config("configs/tiny.py", [f"model_type={model_type}", "model.vocab_size=96", "data.seq_len=16",
                                           "model.hidden_size=64", "model.num_attention_heads=4",
                                           "model.num_layers=2", "model.multiple_of=32", *extra])


def random_model(cfg, seed=0):
    torch.manual_seed(seed)
    m = build_model(cfg)
    with torch.no_grad():
        for p in m.parameters():  # biases and norms too, so that a mis-mapped tensor shows
            p.add_(torch.randn_like(p) * 0.05)
    return m.eval()


# ---- the reference math: HF InternLM / InternLM2 modelling code, written out -------------------------------------

def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def attention(q, k, v, base):
    """q [B, T, H, d], k/v [B, T, H, d] (kv already repeated): causal softmax attention with rotary q/k."""
    T, d = q.shape[1], q.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(T).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None, :, None], emb.sin()[None, :, None]
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    s = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d)
    s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    return torch.einsum("bhts,bshd->bthd", s.softmax(-1), v).flatten(2)


def internlm_v1_logits(t, c, ids):
    """InternLMForCausalLM (InternLM's tools/transformers modeling_internlm.py) on HF tensors `t`."""
    H, nh, eps = c["hidden_size"], c["num_attention_heads"], c["rms_norm_eps"]
    d = H // nh
    rotary, n, m = c["rotary"], ids.shape[1], c.get("max_position_embeddings", 2048)
    base = rotary["base"]
    if rotary.get("type") == "dynamic" and n > m:  # InternLMDynamicNTKScalingRotaryEmbedding, beyond m positions
        f = rotary.get("scaling_factor", 1.0)
        base = base * ((f * n / m) - (f - 1)) ** (d / (d - 2))
    h = t["model.embed_tokens.weight"][ids]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms(h, t[p + "input_layernorm.weight"], eps)
        q, k, v = (F.linear(x, t[p + f"self_attn.{n}_proj.weight"], t.get(p + f"self_attn.{n}_proj.bias"))
                   .view(*x.shape[:2], nh, d) for n in "qkv")
        h = h + F.linear(attention(q, k, v, base), t[p + "self_attn.o_proj.weight"],
                         t.get(p + "self_attn.o_proj.bias"))
        x = rms(h, t[p + "post_attention_layernorm.weight"], eps)
        h = h + F.linear(F.silu(F.linear(x, t[p + "mlp.gate_proj.weight"])) * F.linear(x, t[p + "mlp.up_proj.weight"]),
                         t[p + "mlp.down_proj.weight"])
    return F.linear(rms(h, t["model.norm.weight"], eps), t["lm_head.weight"])


def internlm2_logits(t, c, ids):
    """InternLM2ForCausalLM (modeling_internlm2.py: packed wqkv "(h gs d)", w2 = down, w3 = up) on HF tensors."""
    H, nh, nkv, eps = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["rms_norm_eps"]
    d, n = H // nh, nh // nkv
    h = t["model.tok_embeddings.weight"][ids]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms(h, t[p + "attention_norm.weight"], eps)
        qkv = F.linear(x, t[p + "attention.wqkv.weight"]).view(*x.shape[:2], nkv, n + 2, d)
        q = qkv[..., :n, :].reshape(*x.shape[:2], nh, d)
        k = qkv[..., -2, :].repeat_interleave(n, dim=2)  # repeat_kv: each kv head serves its n query heads
        v = qkv[..., -1, :].repeat_interleave(n, dim=2)
        h = h + F.linear(attention(q, k, v, c["rope_theta"]), t[p + "attention.wo.weight"])
        x = rms(h, t[p + "ffn_norm.weight"], eps)
        h = h + F.linear(F.silu(F.linear(x, t[p + "feed_forward.w1.weight"])) *
                         F.linear(x, t[p + "feed_forward.w3.weight"]), t[p + "feed_forward.w2.weight"])
    out = t.get("output.weight", t["model.tok_embeddings.weight"])
    return F.linear(rms(h, t["model.norm.weight"], eps), out)


# ---- InternLM's convert2hf.py rules, written out (InternLM/InternLM tools/transformers/convert2hf.py) -------------

def internlm_convert2hf(folder):
    """What InternLM's converter does with a folder: model_config.pt, every model_tp{t}_pp{p}.pt (torch.load),
    pipeline merge by layer shift, "model." removed, tensor shards merged, HF InternLM names."""
    cfg = torch.load(os.path.join(folder, "model_config.pt"))
    names = [n for n in os.listdir(folder) if n.startswith("model_t") and not n.endswith("md5")]
    max_tp = max(int(os.path.splitext(n)[0].split("_")[1][2:]) for n in names) + 1
    max_pp = max(int(os.path.splitext(n)[0].split("_")[2][2:]) for n in names) + 1
    states = []
    for tp in range(max_tp):
        shift, merged = 0, {}
        for pp in range(max_pp):
            sd, top = torch.load(os.path.join(folder, f"model_tp{tp}_pp{pp}.pt")), 0
            for key, value in sd.items():
                if key.endswith(".inv_freq"):
                    continue
                m, name = re.search(r"\.\d+\.", key), key
                if m is not None:
                    s, e = m.span()
                    top = max(top, int(key[s + 1:e - 1]))
                    name = key[:s] + f".{int(key[s + 1:e - 1]) + shift}." + key[e:]
                merged[name[6:] if name.startswith("model.") else name] = value
            shift += top + 1
        states.append(merged)
    n, nh, dim = len(states), cfg["num_attention_heads"], cfg["hidden_size"]
    out = {}
    for i in range(cfg["num_layers"]):
        w = [states[t].pop(f"blocks.{i}.mixer.Wqkv.weight").reshape(3, nh // n, -1, dim) for t in range(n)]
        b = [states[t].pop(f"blocks.{i}.mixer.Wqkv.bias").reshape(3, nh // n, -1) for t in range(n)]
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = states[0][f"blocks.{i}.norm1.weight"]
        out[p + "post_attention_layernorm.weight"] = states[0][f"blocks.{i}.norm2.weight"]
        for j, x in enumerate("qkv"):
            out[p + f"self_attn.{x}_proj.weight"] = torch.cat([w[t][j] for t in range(n)], 0).reshape(dim, dim)
            out[p + f"self_attn.{x}_proj.bias"] = torch.cat([b[t][j] for t in range(n)], 0).reshape(-1)
        out[p + "self_attn.o_proj.weight"] = torch.cat([s[f"blocks.{i}.mixer.out_proj.weight"] for s in states], 1)
        out[p + "self_attn.o_proj.bias"] = states[0][f"blocks.{i}.mixer.out_proj.bias"]
        out[p + "mlp.gate_proj.weight"] = torch.cat([s[f"blocks.{i}.mlp.w1.weight"] for s in states], 0)
        out[p + "mlp.down_proj.weight"] = torch.cat([s[f"blocks.{i}.mlp.w3.weight"] for s in states], 1)
        out[p + "mlp.up_proj.weight"] = torch.cat([s[f"blocks.{i}.mlp.w2.weight"] for s in states], 0)
    assert cfg["embed_split_hidden"]
    out["model.norm.weight"] = states[0]["norm.weight"]
    out["model.embed_tokens.weight"] = torch.cat([s["embedding.weight"] for s in states], 1)
    out["lm_head.weight"] = torch.cat([s["head.weight"] for s in states], 0)
    hf_cfg = {"hidden_size": dim, "num_attention_heads": nh, "num_hidden_layers": cfg["num_layers"],
              "rms_norm_eps": cfg["layer_norm_epsilon"], "rotary": {"base": cfg.get("rope_base", 10000)}}
    return out, hf_cfg


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_our_internlm_folder_converts_with_internlms_converter(tmp_path, tp, pp):
    cfg = tiny("INTERNLM", "model.num_layers=3")
    model = random_model(cfg)
    files = write_internlm_folder(tmp_path, cfg, model.state_dict(), tp=tp, pp=pp, dtype="float32")
    assert sorted(f.name for f in files) == sorted([f"model_tp{t}_pp{p}.pt" for t in range(tp) for p in range(pp)]
                                                   + ["model_config.pt"])
    stage0 = torch.load(tmp_path / "model_tp0_pp0.pt")
    assert "model.embedding.weight" in stage0 and "model.blocks.0.mixer.Wqkv.weight" in stage0
    if pp == 2:  # InternLM's partition_uniform: 1 layer, then 2, each stage numbered from 0
        assert not any(k.startswith("model.blocks.1.") for k in stage0)
        assert "model.head.weight" in torch.load(tmp_path / "model_tp0_pp1.pt")
    hf, c = internlm_convert2hf(tmp_path)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (internlm_v1_logits(hf, c, ids) - model(ids)).abs().max().item()
    assert diff <= TOL, diff
    back = build_model(cfg)  # and our own reader takes it back, whatever the split
    assert len(load_internlm(back, tmp_path, "INTERNLM")) == len(model.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_internevo_internlm2_folder_round_trip_and_interleaved_qk(tmp_path):
    cfg = tiny("INTERNLM2", "model.num_kv_attention_heads=2")
    model = random_model(cfg)
    write_internlm_folder(tmp_path / "a", cfg, model.state_dict(), tp=2, pp=1, dtype="float32")
    shards, conf = read_internlm_folder(tmp_path / "a")
    assert conf["num_kv_attention_heads"] == 2 and conf["qk_interleaved"] is False
    assert shards[0]["layers.0.attention.wqkv.weight"].shape == (64, 64)  # one of two groups: (2 q + k + v) x 16
    back = build_model(cfg)
    load_internlm(back, tmp_path / "a", "INTERNLM2")
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())
    # a checkpoint trained with qk_interleaved=True keeps q/k channels in pairs: permuted back on load
    d = 16
    perm = torch.stack([torch.arange(d // 2), torch.arange(d // 2) + d // 2], 1).flatten()  # halves → pairs
    for t in range(2):
        path = tmp_path / "a" / f"model_tp{t}_pp0.pt"
        sd = torch.load(path)
        for k in [k for k in sd if k.endswith("wqkv.weight")]:
            w = sd[k].view(1, 4, d, 64)  # this shard's group: q, q, k, v
            w[:, :3] = w[:, :3, perm]
        torch.save(sd, path)
    conf["qk_interleaved"] = True
    torch.save(conf, tmp_path / "a" / "model_config.pt")
    again = build_model(cfg)
    load_internlm(again, tmp_path / "a", "INTERNLM2")
    assert all(torch.equal(again.state_dict()[k], v) for k, v in model.state_dict().items())


def test_internlm_v1_folder_in_internevos_later_ffn_names(tmp_path):
    """InternEvo's later FeedForward names up w3 and down w2 (InternLM v1: w2 up, w3 down): such a folder, split over
    2 tensor ranks, loads by the shapes to the same weights."""
    cfg = tiny()
    model = random_model(cfg)
    write_internlm_folder(tmp_path, cfg, model.state_dict(), tp=2, pp=1, dtype="float32")
    for t in range(2):
        path = tmp_path / f"model_tp{t}_pp0.pt"
        sd = torch.load(path)
        renamed = {re.sub(r"mlp\.w([23])\.", lambda m: f"mlp.w{5 - int(m.group(1))}.", k): v for k, v in sd.items()}
        assert renamed["model.blocks.0.mlp.w2.weight"].shape == (64, 96)  # down [H, F / tp] under the later name
        torch.save(renamed, path)
    back = build_model(cfg)
    load_internlm(back, tmp_path, "INTERNLM")
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


def test_crafted_pt_is_refused_without_running_code(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"model.embedding.weight": Evil()}, tmp_path / "model_tp0_pp0.pt")
    with pytest.raises(CheckpointError, match=r"model_tp0_pp0\.pt: not a plain tensor file, refused by "
                                              r"torch\.load\(weights_only=True\)"):
        load_internlm(build_model(tiny()), tmp_path, "INTERNLM")
    assert not marker.exists()
    (tmp_path / "model_tp0_pp0.pt").unlink()
    torch.save({}, tmp_path / "model_tp1_pp0.pt")
    with pytest.raises(CheckpointError, match=r"model_tp0_pp0\.pt is missing"):
        load_internlm(build_model(tiny()), tmp_path, "INTERNLM")


def write_hf(folder, tensors, config):
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))


def test_hf_internlm_v1_import_and_export_against_its_math(tmp_path):
    g = torch.Generator().manual_seed(5)
    H, V, I, L = 64, 96, 160, 2
    r = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    t = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": 1 + r(H), "lm_head.weight": r(V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": 1 + r(H), p + "post_attention_layernorm.weight": 1 + r(H),
                  p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H),
                  p + "mlp.down_proj.weight": r(H, I)})
        for x in "qkvo":
            t[p + f"self_attn.{x}_proj.weight"], t[p + f"self_attn.{x}_proj.bias"] = r(H, H), r(H)
    c = {"architectures": ["InternLMForCausalLM"], "model_type": "internlm", "vocab_size": V, "hidden_size": H,
         "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": 4, "rms_norm_eps": 1e-6,
         "bias": True, "rotary": {"base": 10000, "type": "dynamic"}, "tie_word_embeddings": False,
         "max_position_embeddings": 8}  # dynamic NTK beyond 8 positions: the 16 tokens here are
    write_hf(tmp_path / "hf", t, c)
    with pytest.raises(CheckpointError, match="InternLMForCausalLM's rope_scaling=.*'dynamic'.* vs model.rope_scaling"):
        load_hf(build_model(tiny("INTERNLM", "model.intermediate_size=160", "model.layer_norm_epsilon=1e-6")),
                tmp_path / "hf", "INTERNLM")  # plain rotary: another model past 8 tokens (loaded silently before)
    cfg = tiny("INTERNLM", "model.intermediate_size=160", "model.layer_norm_epsilon=1e-6",
               "model.rope_scaling={'type': 'dynamic', 'factor': 1.0, 'original_max_position_embeddings': 8}")
    model = build_model(cfg).eval()
    assert len(load_hf(model, tmp_path / "hf", "INTERNLM")) == len(t)
    ids = torch.randint(0, V, (2, 16), generator=g)
    with torch.no_grad():
        ref = internlm_v1_logits(t, c, ids)
        assert (model(ids) - ref).abs().max().item() <= TOL
    export_hf(tmp_path / "out", cfg, model.state_dict(), tokenizer=None, arch="internlm")
    out_c = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out_c["architectures"] == ["InternLMForCausalLM"] and out_c["bias"] is True
    assert out_c["rotary"] == {"base": 10000.0, "type": "dynamic", "scaling_factor": 1.0}
    assert out_c["max_position_embeddings"] == 8
    assert out_c["auto_map"]["AutoModelForCausalLM"] == "modeling_internlm.InternLMForCausalLM"
    out_t = read_hf_tensors(tmp_path / "out")
    assert out_t.keys() == t.keys() and all(torch.equal(out_t[k], t[k]) for k in t)


@pytest.mark.parametrize("tie", [False, True])
def test_hf_internlm2_import_and_export_against_its_math(tmp_path, tie):
    g = torch.Generator().manual_seed(6)
    H, V, I, L, nh, nkv = 64, 96, 160, 2, 4, 2
    r = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    t = {"model.tok_embeddings.weight": r(V, H), "model.norm.weight": 1 + r(H)}
    if not tie:
        t["output.weight"] = r(V, H)
    for i in range(L):
        p = f"model.layers.{i}."
        t.update({p + "attention_norm.weight": 1 + r(H), p + "ffn_norm.weight": 1 + r(H),
                  p + "attention.wqkv.weight": r((nh + 2 * nkv) * 16, H), p + "attention.wo.weight": r(H, H),
                  p + "feed_forward.w1.weight": r(I, H), p + "feed_forward.w3.weight": r(I, H),
                  p + "feed_forward.w2.weight": r(H, I)})
    c = {"architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2", "vocab_size": V, "hidden_size": H,
         "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": nh, "num_key_value_heads": nkv,
         "rms_norm_eps": 1e-5, "bias": False, "rope_theta": 1e6, "rope_scaling": None, "tie_word_embeddings": tie}
    write_hf(tmp_path / "hf", t, c)
    cfg = tiny("INTERNLM2", "model.intermediate_size=160", "model.num_kv_attention_heads=2", "model.rope_base=1e6",
               f"model.tie_word_embeddings={tie}")
    model = build_model(cfg).eval()
    load_hf(model, tmp_path / "hf", "INTERNLM2")
    ids = torch.randint(0, V, (2, 16), generator=g)
    with torch.no_grad():
        assert (model(ids) - internlm2_logits(t, c, ids)).abs().max().item() <= TOL
    export_hf(tmp_path / "out", cfg, model.state_dict(), tokenizer=None, arch="internlm2")
    out_c = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out_c["architectures"] == ["InternLM2ForCausalLM"] and out_c["num_key_value_heads"] == 2
    out_t = read_hf_tensors(tmp_path / "out")
    assert out_t.keys() == t.keys() and all(torch.equal(out_t[k], t[k]) for k in t)
    with pytest.raises(CheckpointError, match="InternLMForCausalLM: model_type INTERNLM2 reads"):
        export_hf(tmp_path / "x", cfg, model.state_dict(), tokenizer=None, arch="internlm")


def test_convert2internlm_cli_from_a_training_checkpoint(tmp_path, capsys):
    import sys
    from pathlib import Path

    from internlm_core.checkpoint import CheckpointManager
    from internlm_core.config import dump_yaml

    root = Path(__file__).resolve().parents[2]
    cfg = tiny("INTERNLM", "ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder={tmp_path / 'ckpts'}")
    model = random_model(cfg)
    mgr = CheckpointManager(cfg.ckpt, config_text=dump_yaml(cfg))
    mgr.register_model(model)
    mgr.save(5, "test")
    mgr.close()
    sys.path.insert(0, str(root / "tools"))
    import convert2internlm

    assert convert2internlm.main([str(tmp_path / "ckpts"), str(tmp_path / "out"), "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "newest complete checkpoint" in out and "INTERNLM -> InternLM folder, tensor 2 x pipeline 1" in out
    back = build_model(cfg)
    load_internlm(back, tmp_path / "out", "INTERNLM")
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


def test_hf_internlm2_folder_without_bias_key_has_bias(tmp_path):
    """InternLM2Config's `bias` defaults to true (its remote code: wqkv and wo with bias): a config.json without the
    key is read with qkv_bias and its bias tensors load (before: read as false, the biases refused as leftovers)."""
    g = torch.Generator().manual_seed(7)
    H, V, I, L, nh, nkv = 64, 96, 160, 1, 4, 2
    r = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    p = "model.layers.0."
    t = {"model.tok_embeddings.weight": r(V, H), "model.norm.weight": 1 + r(H), "output.weight": r(V, H),
         p + "attention_norm.weight": 1 + r(H), p + "ffn_norm.weight": 1 + r(H),
         p + "attention.wqkv.weight": r((nh + 2 * nkv) * 16, H), p + "attention.wqkv.bias": r((nh + 2 * nkv) * 16),
         p + "attention.wo.weight": r(H, H), p + "attention.wo.bias": r(H), p + "feed_forward.w1.weight": r(I, H),
         p + "feed_forward.w3.weight": r(I, H), p + "feed_forward.w2.weight": r(H, I)}
    c = {"architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2", "vocab_size": V, "hidden_size": H,
         "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": nh, "num_key_value_heads": nkv,
         "rms_norm_eps": 1e-6}
    write_hf(tmp_path, t, c)
    keys = config_from_hf(tmp_path, "INTERNLM2")
    assert keys["qkv_bias"] is True
    model = build_model(tiny("INTERNLM2", *[f"model.{k}={v!r}" for k, v in keys.items()]))
    load_hf(model, tmp_path, "INTERNLM2")
    wo_bias = dict(model.named_parameters())["layers.0.attention.wo.bias"]
    assert torch.equal(wo_bias.detach(), t[p + "attention.wo.bias"])
