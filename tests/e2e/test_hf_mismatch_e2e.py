"""train.py with ckpt_type "hf" trains the folder's model or stops in one line (issue 36): configs/tiny.py's shape
with the folder's numbers left at their defaults (rope_theta 5e5, rms_norm_eps 1e-6; Mixtral top-1) takes the
folder's values, and with lr 0 the export of the run gives transformers' logits of the folder itself (1e-4); the
same run with the config's other value set explicitly exits non-zero with one line naming both."""

import json
import os

import pytest
import torch

from tests.helpers.launch import run_script, run_train

pytestmark = pytest.mark.slow
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)  # configs/tiny.py's shape, kv heads its default
FOLDERS = {  # model_type: (class, config beyond TINY, the key the config then sets otherwise, the line's words)
    "LLAMA": ("Llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 5e5}, rms_norm_eps=1e-6),
              "model.rope_base=10000.0", "rope_parameters.rope_theta=500000.0 vs model.rope_base=10000.0"),
    "MIXTRAL": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=1, rms_norm_eps=1e-6),
                "moe.top_k=2", "num_experts_per_tok=1 vs moe.top_k=2"),
}


@pytest.mark.parametrize("model_type", list(FOLDERS))
def test_train_py_trains_the_folders_model_or_refuses(tmp_path, model_type):
    cls, kw, other, words = FOLDERS[model_type]
    hf_in, ckpts, out = tmp_path / "hf_in", tmp_path / "ckpts", tmp_path / "hf_out"
    torch.manual_seed(0)
    folder = getattr(transformers, f"{cls}ForCausalLM")(getattr(transformers, f"{cls}Config")(**TINY, **kw)).eval()
    folder.save_pretrained(hf_in)
    info = {"path": str(hf_in), "content": ["model"], "ckpt_type": "hf"}
    sets = [f"model_type={model_type}", "model.intermediate_size=384", "data.seq_len=64", "data.total_steps=2",
            "data.valid_every=0", "adam.lr=0.0", "lr_scheduler.eta_min=0.0", "adam.weight_decay=0.0", f"ckpt.load_ckpt_info={info!r}",
            "ckpt.auto_resume=False", "ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder={ckpts}",
            "ckpt.checkpoint_every=2", *(["model.num_experts=4", "model.moe_type=Dropless"] if cls == "Mixtral" else [])]
    p = run_train(["--config", "configs/tiny.py", "--run-dir", str(tmp_path / "refused"), "--set", *sets, other])
    assert p.returncode != 0
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if words in ln]
    assert lines and "config.json defines the model it holds, the config sets otherwise" in lines[0], p.stderr[-2000:]
    p = run_train(["--config", "configs/tiny.py", "--run-dir", str(tmp_path / "run"), "--set", *sets])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "taken from the Hugging Face folder's config.json" in p.stdout + p.stderr
    p = run_script("tools/convert2hf.py", [str(ckpts), str(out), "--tokenizer", "none"], timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    conf = json.loads((out / "config.json").read_text())
    assert conf["rms_norm_eps"] == 1e-6 and conf["num_key_value_heads"] == 2
    assert conf["rope_theta"] == (5e5 if cls == "Llama" else 1e6)  # Mixtral's default rope_theta: 1e6
    assert conf.get("num_experts_per_tok", 1) == 1
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # lr 0: the run's model is the folder's, with the folder's numbers
        assert (theirs(ids).logits - folder(ids).logits).abs().max().item() <= 1e-4


def test_tensors_nothing_reads_stop_every_rank(tmp_path):
    """A folder with a tensor the model has no place for (o_proj.bias of a Llama folder loaded into LLAMA without
    biases): 2 FSDP ranks both stop with the line naming it (rank 0 finds it, every rank raises it; none hangs)."""
    from safetensors.torch import load_file, save_file

    hf_in = tmp_path / "hf_in"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(hf_in)
    tensors = load_file(hf_in / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(128)
    save_file(tensors, hf_in / "model.safetensors", metadata={"format": "pt"})
    info = {"path": str(hf_in), "content": ["model"], "ckpt_type": "hf"}
    p = run_train(["--config", "configs/tiny.py", "--run-dir", str(tmp_path / "run"), "--set", "model_type=LLAMA",
                   "model.intermediate_size=384", "data.seq_len=64", "data.total_steps=1", "data.valid_every=0",
                   "parallel.zero1=-1", f"ckpt.load_ckpt_info={info!r}", "ckpt.auto_resume=False"],
                  nproc=2, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert ("1 tensor(s) of the folder that nothing in the LLAMA model reads: model.layers.0.self_attn.o_proj.bias"
            in out), out[-3000:]
