"""DEEPSEEK_V3 against transformers' DeepseekV3ForCausalLM (fp32, tiny random configs, offline): a folder
transformers saved imports with the same logits, our export loads in transformers with the same logits (DeepSeek-V3's
shape: low-rank queries, YaRN with mscale_all_dim, group-limited routing, interleaved rope weights; Moonlight's:
full-rank queries, no rope scaling); a block-scaled FP8 folder imports dequantized; the refusals; the parameter
counts of the module and of the published shapes."""

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from internlm_core.checkpoint.fp8_blocks import dequantize  # noqa: E402
from internlm_core.checkpoint.hf import config_from_hf, export_hf, load_hf  # noqa: E402
from internlm_core.config import load_config  # noqa: E402
from internlm_core.errors import CheckpointError, ConfigError  # noqa: E402
from internlm_core.model import build_model, count_parameters, get_model_spec, model_args  # noqa: E402
from internlm_core.model.deepseek_v3.counts import active_parameters  # noqa: E402

V3 = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
          num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8,
          routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
          qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
          max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
          rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                               beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0))
MOONLIGHT = dict(V3, q_lora_rank=None, n_group=1, topk_group=1, routed_scaling_factor=2.446,
                 rope_parameters=dict(rope_type="default", rope_theta=50000.0))


def hf_model(shape, seed=3):
    torch.manual_seed(seed)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**shape)).eval()
    with torch.no_grad():  # weights large enough that routing and every term matter; norms away from 1
        for n, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if "norm" in n else 0.05))
        for layer in hf.model.layers[shape["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    return hf


def ours_for(folder, extra=()):
    keys = config_from_hf(folder)
    cfg = load_config("configs/tiny.py", ["model_type=DEEPSEEK_V3", "data.seq_len=64", "model.dtype=torch.float32",
                                          *[f"{k if '.' in k else 'model.' + k}={v!r}" for k, v in keys.items()],
                                          *extra])
    return cfg, build_model(cfg)


def logits(model, vocab=300, hf=False):
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (2, 48))
    with torch.no_grad():
        return model(ids).logits if hf else model(ids)


@pytest.mark.parametrize("shape", [V3, MOONLIGHT], ids=["deepseek_v3", "moonlight"])
def test_import_and_export_logits_equal_transformers(tmp_path, shape):
    hf = hf_model(shape)
    hf.save_pretrained(tmp_path / "hf")
    cfg, model = ours_for(tmp_path / "hf")
    assert cfg.moe.num_expert_groups == shape["n_group"] and cfg.model.first_k_dense_replace == 1
    loaded = load_hf(model, tmp_path / "hf")
    assert set(loaded) >= {n for n, _ in model.named_parameters()}
    assert count_parameters(model) == sum(p.numel() for p in hf.parameters())
    reference = logits(hf, hf=True)
    assert (logits(model.eval()) - reference).abs().max().item() <= 1e-4
    export_hf(tmp_path / "out", cfg, model.state_dict(), tokenizer=None)
    conf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert conf["architectures"] == ["DeepseekV3ForCausalLM"] and conf["rope_interleave"] is True
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert (logits(back, hf=True) - reference).abs().max().item() <= 1e-4
    # the exported weights are the folder's (rope rows interleaved back)
    saved, exported = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(saved[k], exported[k]) for k in saved if "rotary" not in k)


def _quantize(w, block=128):
    """Blockwise float8_e4m3fn and scale_inv (amax / 448 per block), as DeepSeek's FP8 folders hold them."""
    rows, cols = w.shape
    scale = torch.zeros(-(-rows // block), -(-cols // block))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = part.abs().max().clamp_min(1e-12) / 448.0
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (part / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def test_fp8_block_scaled_folder_imports_dequantized(tmp_path):
    hf = hf_model(V3, seed=5)
    hf.save_pretrained(tmp_path / "fp8")
    hf.save_pretrained(tmp_path / "ref")
    sd = load_file(tmp_path / "fp8" / "model.safetensors")
    fp8, ref = {}, {}
    for k, v in sd.items():  # DeepSeek quantizes the linear weights, not the embedding, head, norms or routers
        if v.dim() == 2 and k.endswith("proj.weight") and "embed" not in k:
            q, s = _quantize(v)
            fp8[k], fp8[k + "_scale_inv"] = q, s
            ref[k] = q.float() * s.repeat_interleave(128, 0)[:v.shape[0]].repeat_interleave(128, 1)[:, :v.shape[1]]
        else:
            fp8[k] = ref[k] = v
    save_file(fp8, tmp_path / "fp8" / "model.safetensors", metadata={"format": "pt"})
    save_file(ref, tmp_path / "ref" / "model.safetensors", metadata={"format": "pt"})
    conf = json.loads((tmp_path / "fp8" / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128]}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(conf))
    _, model = ours_for(tmp_path / "fp8")
    load_hf(model, tmp_path / "fp8")
    _, dequantized = ours_for(tmp_path / "ref")
    load_hf(dequantized, tmp_path / "ref")
    got = logits(model.eval())
    assert torch.equal(got, logits(dequantized.eval()))  # the dequantized weights exactly
    original = logits(hf, hf=True)
    # e4m3 keeps 3 mantissa bits: each weight within 1/16 of itself (or 2^-9 of its block's scale, subnormals) ...
    for k, w in sd.items():
        if k + "_scale_inv" in fp8:
            scale = fp8[k + "_scale_inv"].max()
            assert bool(((ref[k] - w).abs() <= torch.maximum(w.abs() / 16, scale * 2 ** -9)).all()), k
    # ... and the logits of this random model within 20% (relative norm; measured 13%: the rounding of ~20
    # matrices compounds, and a few tokens' top-k experts flip) of the original
    assert ((got - original).norm() / original.norm()).item() <= 0.2
    conf["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(conf))
    with pytest.raises(CheckpointError, match="only block-scaled FP8 folders"):
        load_hf(model, tmp_path / "fp8")


def test_dequantize_partial_blocks():
    w = torch.randn(300, 200)
    q, s = _quantize(w)
    assert s.shape == (3, 2)
    out = dequantize(q, s, (128, 128))
    assert torch.equal(out[130:140, 150:160], q[130:140, 150:160].float() * s[1, 1])
    with pytest.raises(CheckpointError, match="expected one scale per 128 x 128 block"):
        dequantize(q, s[:2], (128, 128))


def test_folder_refusals(tmp_path):
    hf = hf_model(V3)
    hf.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)  # an MTP layer (num_nextn_predict_layers 1)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert config_from_hf(tmp_path)["mtp"] == 1  # an MTP layer sets model.mtp's depth (tests/unit/test_mtp_deepseek.py)
    conf = json.loads((tmp_path / "config.json").read_text())
    # Kimi-K2's folders name their model_type kimi_k2 (remote code) with DeepseekV3ForCausalLM's architecture
    (tmp_path / "config.json").write_text(json.dumps({**conf, "num_nextn_predict_layers": 0, "model_type": "kimi_k2"}))
    assert config_from_hf(tmp_path)["moe.num_expert_groups"] == 4
    for key, value, message in (("rope_interleave", False, "rope_interleave=false"),
                                ("attention_bias", True, "attention_bias=true"),
                                ("num_key_value_heads", 2, "num_key_value_heads=2 != num_attention_heads=4")):
        (tmp_path / "config.json").write_text(json.dumps({**conf, "num_nextn_predict_layers": 0, key: value}))
        with pytest.raises(CheckpointError, match=message):
            config_from_hf(tmp_path)


def test_config_refusals():
    base = ["model_type=DEEPSEEK_V3", "model.num_experts=4", "model.moe_type=Dropless", "moe.top_k=2",
            "model.kv_lora_rank=16", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=8",
            "model.intermediate_size=64", "model.moe_intermediate_size=32"]
    load_config("configs/tiny.py", base)
    for extra, message in ((["model.qk_rope_head_dim=7"], "model.qk_rope_head_dim: model_type DEEPSEEK_V3 needs an even"),
                           (["model.qk_norm=True"], "model.qk_norm=True: model_type DEEPSEEK_V3 has no such option"),
                           (["model.moe_use_residual=True"], "model.moe_use_residual=True"),
                           (["model.num_kv_attention_heads=2"], "latent attention expands keys and values"),
                           (["moe.num_expert_groups=3"], "moe.num_expert_groups: expected an int >= 1 dividing"),
                           (["parallel.tensor=3"], "parallel.tensor \\(3\\) must divide")):
        with pytest.raises(ConfigError, match=message):
            load_config("configs/tiny.py", base + extra)
    with pytest.raises(ConfigError, match="model.kv_lora_rank=16: model_type LLAMA has no such option"):
        load_config("configs/tiny.py", ["model_type=LLAMA", "model.kv_lora_rank=16"])
    with pytest.raises(ConfigError, match="moe.top_k_groups=2: model_type MIXTRAL has no such option"):
        load_config("configs/tiny.py", ["model_type=MIXTRAL", "model.num_experts=4", "moe.top_k_groups=2"])


def test_parameter_counts_module_and_published():
    cfg = load_config("configs/tiny.py", ["model_type=DEEPSEEK_V3", "model.num_experts=4", "model.moe_type=Dropless",
                                          "moe.top_k=2", "model.kv_lora_rank=16", "model.q_lora_rank=24",
                                          "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8",
                                          "model.v_head_dim=12", "model.intermediate_size=64",
                                          "model.moe_intermediate_size=32", "model.num_shared_experts=1",
                                          "model.first_k_dense_replace=1"])
    spec = get_model_spec("DEEPSEEK_V3")
    assert spec.num_parameters(model_args(cfg)) == count_parameters(build_model(cfg, device="meta"))
    # DeepSeek-V3: 671B total / 37B activated; Kimi-K2 1.04T / 32B; Moonlight ~16B / ~3B (their model cards)
    for size, total, active in (("671B", 671e9, 37e9), ("kimi_k2", 1.04e12, 32e9),
                                ("moonlight_16B_A3B", 16e9, 3e9)):
        shape = dict(spec.sizes[size])
        over = [f"model.{k}={v!r}" for k, v in shape.items()]
        a = model_args(load_config("configs/tiny.py", ["model_type=DEEPSEEK_V3", *over]).model_inputs())
        assert abs(spec.num_parameters(a) / total - 1) < 0.05, (size, spec.num_parameters(a))
        assert abs(active_parameters(a) / active - 1) < 0.1, (size, active_parameters(a))


@pytest.mark.parametrize("features", ["NATIVE", "EMULATED"])  # the linears and the estimator read them: pinned
@pytest.mark.parametrize("dtype,bound", [("torch.float32", 0.03), ("torch.bfloat16", 0.10)])
def test_activation_terms_match_saved_tensors(dtype, bound, features):
    """The estimator's latent-attention and MoE terms against what autograd saves (tests/unit/test_estimate.py's
    measure): measured fp32 -0.5%, bf16 -7% (the experts' and shared experts' per-linear autocast casts, which the
    MoE families' shared terms do not count)."""
    from internlm_core.estimate import estimate
    from tests.unit.test_estimate import saved_bytes
    cfg = load_config("configs/tiny.py", ["model_type=DEEPSEEK_V3", "model.num_layers=3", "model.vocab_size=512",
                                          "model.num_experts=4", "model.moe_type=Dropless", "moe.top_k=2",
                                          "model.kv_lora_rank=32", "model.q_lora_rank=48", "model.qk_nope_head_dim=32",
                                          "model.qk_rope_head_dim=16", "model.v_head_dim=32",
                                          "model.intermediate_size=128", "model.moe_intermediate_size=64",
                                          "model.num_shared_experts=1", "model.first_k_dense_replace=1",
                                          "moe.score_func=sigmoid", f"model.dtype={dtype}"])
    from internlm_core.utils.cpu_features import CpuFeatures, pinned
    with pinned(getattr(CpuFeatures, features)):
        e = estimate(cfg, 1, device="cpu")
        measured, _ = saved_bytes(cfg, getattr(torch, dtype.split(".")[1]),
                                  torch.tensor([0, 100, 256, 300, 512], dtype=torch.int32), e.cross_entropy)
    assert abs((e.memory.activations + e.memory.weight_copies) / measured - 1) < bound, (features, dtype)


def test_folder_keys_taken_into_the_run_and_a_conflict_refused(tmp_path):
    hf_model(V3).save_pretrained(tmp_path / "hf")
    conf = tmp_path / "run.py"
    conf.write_text(f"model_type = 'DEEPSEEK_V3'\ndata = dict(seq_len=64)\nckpt = dict(auto_resume=False, "
                    f"load_ckpt_info=dict(path='{tmp_path / 'hf'}', content=('model',), ckpt_type='hf'))\n")
    cfg = load_config(str(conf), [])
    m, r = cfg.model, cfg.moe
    assert (m.q_lora_rank, m.kv_lora_rank, m.v_head_dim, m.num_shared_experts, m.first_k_dense_replace) == (24, 16, 12, 2, 1)
    assert (r.score_func, r.num_expert_groups, r.top_k_groups, r.routed_scaling_factor) == ("sigmoid", 4, 2, 2.5)
    with pytest.raises(ConfigError, match="kv_lora_rank=16 vs model.kv_lora_rank=8"):
        load_config(str(conf), ["model.kv_lora_rank=8"])


@pytest.mark.parametrize("case", ["keys_left_out", "no_shared_experts"])
def test_folders_read_as_transformers_reads_them(tmp_path, case):
    """A config.json without n_group / topk_group / first_k_dense_replace / n_shared_experts means
    DeepseekV3Config's defaults (8, 4, 3, 1; read as 1, 1, 0, 0 before: 8 groups silently became one); a folder of
    n_shared_experts 0 holds zero-width shared experts, which hold no weight and load (refused before)."""
    shape = dict(V3, n_routed_experts=16, n_group=8, topk_group=4, num_hidden_layers=4, first_k_dense_replace=3,
                 n_shared_experts=1) if case == "keys_left_out" else dict(V3, n_shared_experts=0)
    hf = hf_model(shape)
    hf.save_pretrained(tmp_path / "hf")
    if case == "keys_left_out":
        conf = json.loads((tmp_path / "hf" / "config.json").read_text())
        for key in ("n_group", "topk_group", "first_k_dense_replace", "n_shared_experts"):
            del conf[key]
        (tmp_path / "hf" / "config.json").write_text(json.dumps(conf))
    cfg, model = ours_for(tmp_path / "hf")
    assert (cfg.moe.num_expert_groups, cfg.moe.top_k_groups, cfg.model.first_k_dense_replace,
            cfg.model.num_shared_experts) == ((8, 4, 3, 1) if case == "keys_left_out" else (4, 2, 1, 0))
    load_hf(model, tmp_path / "hf")
    reference = logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval(),
                       hf=True)
    assert (logits(model.eval()) - reference).abs().max().item() <= 1e-4
    export_hf(tmp_path / "out", cfg, model.state_dict(), tokenizer=None)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert (logits(back, hf=True) - reference).abs().max().item() <= 1e-4
