"""A user's path for the new families, on held-out shapes (not those of tests/unit/test_hf_families.py): a folder
transformers saved is imported by train.py (load_ckpt_info ckpt_type "hf"), trained 3 steps and checkpointed,
exported by tools/convert2hf.py, and transformers' logits of the export equal ours of the same folder (1e-4)."""

import json
import os

import pytest
import torch

from tests.helpers.launch import read_metrics, run_script, run_train

pytestmark = pytest.mark.slow
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

HELD_OUT = {
    "QWEN2": ("Qwen2", dict(vocab_size=256, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                            num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=64,
                            tie_word_embeddings=True, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 20000.0})),
    "QWEN3_MoE": ("Qwen3Moe", dict(vocab_size=256, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=3, num_key_value_heads=1, head_dim=24,
                                   max_position_embeddings=64, num_experts=6, num_experts_per_tok=3,
                                   moe_intermediate_size=40, norm_topk_prob=True)),
}


@pytest.mark.parametrize("model_type", list(HELD_OUT))
def test_import_train_export(tmp_path, model_type):
    from internlm_core.checkpoint.hf import config_from_hf, load_hf
    from internlm_core.config import load_config
    from internlm_core.model import build_model

    cls, kw = HELD_OUT[model_type]
    hf_in, ckpts, out = tmp_path / "hf_in", tmp_path / "ckpts", tmp_path / "hf_out"
    torch.manual_seed(0)
    getattr(transformers, f"{cls}ForCausalLM")(getattr(transformers, f"{cls}Config")(**kw)).save_pretrained(hf_in)
    keys = [f"{k if '.' in k else 'model.' + k}={v!r}" for k, v in config_from_hf(hf_in, model_type).items()]
    info = {"path": str(hf_in), "content": ["model"], "ckpt_type": "hf"}
    sets = [f"model_type={model_type}", *keys, "data.seq_len=64", "data.total_steps=3", "data.valid_every=0",
            "model.dtype=torch.float32", "adam.lr=0.001", f"ckpt.load_ckpt_info={info!r}", "ckpt.auto_resume=False",
            "ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder={ckpts}", "ckpt.checkpoint_every=3"]
    p = run_train(["--config", "configs/tiny.py", "--run-dir", str(tmp_path / "run"), "--set", *sets])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert len(losses) == 3 and 4.0 < losses[0] < 7.0  # a random 256-token model: about ln(256) = 5.5
    p = run_script("tools/convert2hf.py", [str(ckpts), str(out), "--tokenizer", "none"], timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert json.loads((out / "config.json").read_text())["architectures"] == [f"{cls}ForCausalLM"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    before = transformers.AutoModelForCausalLM.from_pretrained(hf_in, dtype=torch.float32)
    assert not torch.equal(theirs.model.norm.weight, before.model.norm.weight)  # 3 steps were trained
    cfg = load_config("configs/tiny.py", [*sets[:-5], *[f"{k if '.' in k else 'model.' + k}={v!r}"
                                                         for k, v in config_from_hf(out, model_type).items()]])
    ours = build_model(cfg)
    load_hf(ours, out, model_type)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours.eval()(ids) - theirs(ids).logits).abs().max().item() <= 1e-4
