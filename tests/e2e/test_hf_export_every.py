"""ckpt.hf_export_every: a Hugging Face folder written mid-run beside the DCP checkpoints (one process; two FSDP ranks
each writing their own safetensors shard) loads in transformers, with logits equal to our model loaded from the DCP
checkpoint of the same step; its COMPLETE marker lists every file with its crc32."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.launch import run_train

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

SETS = ["data.total_steps=3", "data.seq_len=64", "data.valid_every=0", "monitor.tensorboard=False",
        "ckpt.enable_save_ckpt=True", "ckpt.checkpoint_every=2", "ckpt.hf_export_every=2", "tokenizer=byte",
        "model.vocab_size=320"]


@pytest.mark.parametrize("nproc", [1, 2])
def test_mid_run_hf_folder_equals_the_dcp_checkpoint(tmp_path, nproc):
    from internlm_core.checkpoint import CheckpointManager, file_crc32
    from internlm_core.config import load_config
    from internlm_core.model import build_model

    ckpt = tmp_path / "ckpt"
    sets = [*SETS, f"ckpt.save_ckpt_folder={ckpt}"]
    p = run_train(["--config", "configs/tiny.py", "--run-dir", str(tmp_path / "run"), "--set", *sets], nproc=nproc)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    hf_dir = ckpt / "hf" / "2"
    marker = json.loads((hf_dir / "COMPLETE").read_text())
    assert marker["step"] == 2 and marker["kind"] == "hf" and marker["world_size"] == nproc
    assert all(file_crc32(hf_dir / f) == c for f, c in marker["checksums"].items())
    shards = sorted(f for f in marker["files"] if f.endswith(".safetensors"))
    if nproc == 1:
        assert shards == ["model.safetensors"]
    else:  # each rank wrote its own shard; HF's index names them
        assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == shards
    assert not (ckpt / "hf" / "3").exists()  # step 3 is no multiple of hf_export_every

    cfg = load_config("configs/tiny.py", sets)
    ours = build_model(cfg)
    mgr = CheckpointManager(cfg.ckpt)
    mgr.register_model(ours)
    mgr.load(str(ckpt / "2"), ("model",))
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    torch.manual_seed(5)
    ids = torch.randint(0, 320, (2, 64))
    ours.eval()
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-5, diff
