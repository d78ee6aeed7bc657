"""Dense blocks among MoE blocks (model/moe/mix.py): the rule is transformers' (Qwen3MoeDecoderLayer,
DeepseekV3DecoderLayer), a Qwen3-MoE folder with decoder_sparse_step 2 and mlp_only_layers imports and exports with
transformers' logits (fp32, 1e-4), the counts and the estimator count each block as what it is, and the keys are
refused where they cannot be honoured."""

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
from internlm_core.estimate import estimate  # noqa: E402
from internlm_core.model import build_model, count_parameters, get_model_spec, model_args_from_config  # noqa: E402
from internlm_core.model.internlm.model import FeedForward  # noqa: E402
from internlm_core.model.moe import LayerMix, MoEFeedForward  # noqa: E402

T, V = 32, 320
QWEN = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=T, rms_norm_eps=1e-6, head_dim=16, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=2,
            mlp_only_layers=[3])
OURS = ["model_type=QWEN3_MoE", f"data.seq_len={T}", "model.dtype=torch.float32", f"model.vocab_size={V}",
        "model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4", "model.num_kv_attention_heads=2",
        "model.head_dim=16", "model.intermediate_size=96", "model.moe_intermediate_size=32", "model.num_experts=4",
        "moe.top_k=2", "model.moe_type=Dropless"]


def tiny(*extra):
    return load_config("configs/tiny.py", [*OURS, *extra])


@pytest.mark.parametrize("kw", [dict(decoder_sparse_step=2, mlp_only_layers=[3]), dict(decoder_sparse_step=3),
                                dict(mlp_only_layers=[0, 2])])
def test_the_rule_is_qwen3_moe_decoder_layers(kw):
    kw = {"decoder_sparse_step": 1, "mlp_only_layers": [], **kw}
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**QWEN, "num_hidden_layers": 6, **kw}))
    theirs = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    mix = LayerMix(decoder_sparse_step=kw["decoder_sparse_step"], mlp_only_layers=kw["mlp_only_layers"])
    assert [mix.is_moe(i) for i in range(6)] == theirs and not all(theirs)


def test_first_k_dense_replace_is_deepseek_v3s_rule():
    conf = transformers.DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                         num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
                                         n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                         first_k_dense_replace=2, q_lora_rank=None, kv_lora_rank=16,
                                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    hf = transformers.DeepseekV3ForCausalLM(conf)
    theirs = [type(layer.mlp).__name__ == "DeepseekV3MoE" for layer in hf.model.layers]
    mix = LayerMix(first_k_dense_replace=2)
    assert [mix.is_moe(i) for i in range(4)] == theirs == [False, False, True, True]
    assert mix.dense_prefix(4) == 2 and LayerMix(mlp_only_layers=(1,)).dense_prefix(4) is None


def test_qwen3_moe_with_dense_layers_imports_and_exports_with_transformers_logits(tmp_path):
    conf = transformers.Qwen3MoeConfig(**QWEN)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(conf).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith("gate.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path / "hf")
    keys = config_from_hf(tmp_path / "hf", "QWEN3_MoE")
    assert (keys["decoder_sparse_step"], keys["mlp_only_layers"], keys["intermediate_size"]) == (2, [3], 96)
    cfg = tiny()  # the config leaves the mix at its defaults: the folder's keys are taken (hf_folder.py's rule)
    for k, v in keys.items():
        section, key = ("moe", k.split(".")[1]) if "." in k else ("moe" if k == "top_k" else "model", k)
        setattr(getattr(cfg, section), key, v)
    model = build_model(cfg).eval()
    kinds = [type(b.feed_forward) for b in model.layers.values()]
    assert kinds == [FeedForward, MoEFeedForward, FeedForward, FeedForward]
    assert model.layers["0"].feed_forward.w1.weight.shape == (96, 64)  # the dense width, not the experts'
    assert set(load_hf(model, tmp_path / "hf")) >= {n for n, _ in model.named_parameters()}
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-4
        export_hf(tmp_path / "out", cfg, model.state_dict(), tokenizer=None)
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
        assert (model(ids) - back(ids).logits).abs().max().item() <= 1e-4
    assert [type(layer.mlp).__name__ for layer in back.model.layers] == [type(layer.mlp).__name__
                                                                         for layer in hf.model.layers]
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["decoder_sparse_step"], written["mlp_only_layers"]) == (2, [3])


def test_a_run_that_sets_another_mix_than_the_folder_is_refused(tmp_path):
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN)).save_pretrained(tmp_path)
    load = f"ckpt.load_ckpt_info={{'path': '{tmp_path}', 'content': ('model',), 'ckpt_type': 'hf'}}"
    load = ["ckpt.auto_resume=False", load]
    cfg = load_config("configs/tiny.py", [*OURS, *load])  # the mix keys unset: the folder's
    assert (cfg.model.decoder_sparse_step, cfg.model.mlp_only_layers) == (2, [3])
    with pytest.raises(ConfigError, match="first_k_dense_replace=0 vs model.first_k_dense_replace=1"):
        load_config("configs/tiny.py", [*OURS, *load, "model.first_k_dense_replace=1"])


def test_counts_and_the_estimate_count_dense_and_moe_blocks_apart():
    cfg = tiny("model.first_k_dense_replace=1", "model.mlp_only_layers=[2]")
    spec, args = get_model_spec("QWEN3_MoE"), model_args_from_config(cfg)
    model = build_model(cfg, "meta")
    per_layer = [spec.counts.block(a).count for a in spec.counts.layer_args(args)]
    assert per_layer == [sum(p.numel() for p in b.parameters()) for b in model.layers.values()]
    assert per_layer[0] == per_layer[2] < per_layer[1] == per_layer[3]
    mixed = estimate(cfg, 1, device="cpu")
    assert mixed.parameters == count_parameters(model)
    assert sum(t.value for t in mixed.figures.stage_parameters(4, True, True)) == count_parameters(model)
    # per block, the estimator counts the stack's mean: 2 dense blocks (QWEN3's) and 2 MoE blocks (all-MoE's)
    all_moe = estimate(tiny(), 1, device="cpu")
    moe = all_moe.token_bytes
    # FSDP holds one unit at a time: the largest block's, not the mean
    assert mixed.figures.largest_block_local == all_moe.figures.block_local > mixed.figures.block_local
    dense = estimate(load_config("configs/tiny.py", [o for o in OURS if "MoE" not in o and "expert" not in o
                                                     and "top_k" not in o and "moe" not in o]
                                 + ["model_type=QWEN3"]), 1, device="cpu").token_bytes
    for key in ("block", "checkpointed"):
        assert getattr(mixed.token_bytes, key) == pytest.approx((getattr(dense, key) + getattr(moe, key)) / 2)
    # pipeline 2 with blocks 0-1 dense: the rank of blocks 2-3 (all MoE, the most parameters) is the one counted
    pp = ["model.first_k_dense_replace=2", "parallel.pipeline=2"]
    staged = estimate(load_config("configs/tiny.py", [*OURS, *pp], world_size=2), 2, device="cpu")
    assert staged.token_bytes.block == moe.block and staged.figures.block_local == pytest.approx(
        estimate(load_config("configs/tiny.py", [*OURS, "parallel.pipeline=2"], world_size=2), 2,
                 device="cpu").figures.block_local)
    uniform = tiny()
    # a dense block multiplies its whole FFN (3 * 64 * 96), an MoE block 2 of its 4 experts (2 * 3 * 64 * 32) and
    # the router (4 * 64): 2 dense blocks differ from 2 MoE blocks by 2 * 6 * (18432 - 12288 - 256) FLOPs per token
    assert spec.flops_per_token(args, T) - spec.flops_per_token(model_args_from_config(uniform), T) == 2 * 6 * 5888


@pytest.mark.parametrize("extra, message", [
    (["model_type=LLAMA", "model.first_k_dense_replace=2"], "model.first_k_dense_replace=2: dense blocks among MoE "
                                                             "blocks; model_type 'LLAMA' is dense throughout"),
    (["model.decoder_sparse_step=0"], "model.decoder_sparse_step: expected an int >= 1, got 0"),
    (["model.mlp_only_layers=[1, 4]"], r"model.mlp_only_layers: \[4\] are not blocks of model.num_layers=4"),
    (["model.mlp_only_layers=[0, 1, 2, 3]"], "no block of model.num_layers=4 is MoE; use a dense model_type"),
])
def test_config_refuses_a_mix_it_cannot_build(extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/tiny.py", extra) if extra[0].startswith("model_type=") else tiny(*extra)


def test_classes_without_dense_layers_refuse_a_mix(tmp_path):
    cfg = load_config("configs/tiny.py", ["model_type=MIXTRAL", "model.num_experts=4", "model.num_layers=2",
                                          "model.moe_type=Dropless", "model.decoder_sparse_step=2"])
    with pytest.raises(CheckpointError, match=r"make blocks \[0\] dense: every MixtralForCausalLM layer is MoE"):
        export_hf(tmp_path, cfg, build_model(cfg, "meta").state_dict(), tokenizer=None)
