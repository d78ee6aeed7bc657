"""An InternLM user's and an InternEvo user's first runs: InternLM's own 7B config (aaaf4d7) and InternEvo's
InternLM2 config train 3 steps with the model shape made smaller (and the sequence 64 tokens, so that CPU tests
stay short); the InternEvo run, under its tensor mode isp (context parallel all_to_all over 2 ranks here), starts
from an InternEvo-format checkpoint folder and its first loss equals the loss of that folder's weights loaded
into one process."""

import json
import logging
from pathlib import Path

import pytest
import torch

from internlm_core.checkpoint.internlm_format import write_internlm_folder
from internlm_core.config import load_config
from internlm_core.distributed import LaunchInfo
from internlm_core.model import build_model
from internlm_core.trainer.build import build_trainer
from tests.helpers.launch import read_metrics, run_train

pytestmark = pytest.mark.slow
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.vocab_size=512",
         "data.seq_len=64", "model.dtype=torch.float32", "data.total_steps=3"]


def test_internlm_7b_config_trains_fresh_and_validates_at_the_end(tmp_path, caplog):
    cfg = load_config(FIXTURES / "internlm_7B_sft.py", [*SMALL, f"ckpt.save_ckpt_folder=local:{tmp_path}/ckpts"],
                      world_size=1)
    (tmp_path / "run").mkdir()
    with caplog.at_level(logging.INFO):
        trainer = build_trainer(cfg, LaunchInfo("none", 0, 1, 0, torch.device("cpu"), None), tmp_path / "run")
        trainer.train()
    log = caplog.text
    assert "config keys kept for compatibility only" in log and "lr_scheduler.last_epoch" in log
    assert "parallel.zero1=8 > data-parallel size 1" in log
    assert (f"start: no complete checkpoint under {tmp_path}/ckpts (auto_resume): fresh model, sampler, optimizer, "
            f"scheduler; load_ckpt_info llm_ckpts/xxxx (internlm) not used") in log
    train = read_metrics(tmp_path / "run")
    assert [r["step"] for r in train] == [1, 2, 3] and all(r["loss"] > 5.0 for r in train)
    valid = read_metrics(tmp_path / "run", "valid")
    assert [r["step"] for r in valid] == [3] and valid[0]["valid/val/loss"] > 5.0  # valid_every=50: once, at the end


def test_internevo_internlm2_config_trains_under_isp_from_an_internevo_folder(tmp_path):
    sets = [*SMALL, "model.num_kv_attention_heads=2", "adam.lr=0.0", "lr_scheduler.eta_min=0.0",
            f"monitor.alert.alert_file_path={tmp_path}/alerts.jsonl"]
    cfg = load_config(FIXTURES / "internevo_7B_internlm2.py", sets)
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path / "internevo_ckpt"
    write_internlm_folder(folder, cfg, model.state_dict(), tp=2, dtype="float32")  # as a tensor-2 run saves
    info = {"path": str(folder), "content": ("model",), "ckpt_type": "internevo"}
    p = run_train(["--config", str(FIXTURES / "internevo_7B_internlm2.py"), "--run-dir", str(tmp_path / "run"),
                   "--set", *sets, f"ckpt.load_ckpt_info={info!r}"], nproc=2, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # InternEvo's isp is context parallel here (the 2 ranks share each sequence, all_to_all like its isp)
    assert "parallel.tensor.mode='isp' size 2" in p.stdout + p.stderr and "cp=2" in p.stdout
    assert f"loaded {folder} (type internlm; content model)" in p.stdout
    assert "took model (" in p.stdout and "fresh sampler, optimizer, scheduler" in p.stdout
    assert "hang_timeout 300" not in p.stdout  # no hang in 3 steps, though the watchdog is on (alert file set)
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert len(losses) == 3

    # the same folder loaded into one process gives the first step's loss (lr 0: every step sees these weights)
    one = load_config(FIXTURES / "internevo_7B_internlm2.py", [*sets, "parallel.tensor=1", "parallel.weight={'size': 1}",
                                                              "ckpt.auto_resume=False",
                                                              f"ckpt.load_ckpt_info={info!r}"], world_size=1)
    (tmp_path / "one").mkdir()
    trainer = build_trainer(one, LaunchInfo("none", 0, 1, 0, torch.device("cpu"), None), tmp_path / "one")
    batch = next(iter(trainer.train_loader))
    with torch.no_grad():
        ref = trainer.forward_backward(batch, forward_only=True).item()
    assert abs(losses[0] - ref) <= 1e-4, (losses[0], ref)
    assert json.loads((tmp_path / "run" / "launch.json").read_text())["world_size"] == 2


def test_internevo_moe_config_trains_from_an_internevo_moe_folder_under_expert_parallel(tmp_path):
    """InternEvo's 7B_MoE4 config as written (expert=dict(size=-1): the 2 data-parallel ranks are the expert
    group) starts from an InternEvo MoE folder (experts in model_moe_layer*_expert*_tp*.pt); its losses equal
    the losses of the same folder trained without expert parallel (lr 0: every step sees the folder's weights)."""
    sets = [*SMALL, "adam.lr=0.0", "lr_scheduler.eta_min=0.0", "ckpt.auto_resume=False",
            f"monitor.alert.alert_file_path={tmp_path}/alerts.jsonl"]
    cfg = load_config(FIXTURES / "internevo_7B_MoE4_sft.py", sets)
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path / "internevo_moe_ckpt"
    write_internlm_folder(folder, cfg, model.state_dict(), dtype="float32")
    assert len(list(folder.glob("model_moe_layer*_expert*_tp0.pt"))) == 2 * 4
    info = {"path": str(folder), "content": ("model",), "ckpt_type": "internevo"}
    p = run_train(["--config", str(FIXTURES / "internevo_7B_MoE4_sft.py"), "--run-dir", str(tmp_path / "run"),
                   "--set", *sets, f"ckpt.load_ckpt_info={info!r}"], nproc=2, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"loaded {folder} (type internlm; content model)" in p.stdout and "ep=2" in p.stdout
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert len(losses) == 3

    # the same folder and global batch without expert parallel (each rank all 4 experts): the same losses
    ref = run_train(["--config", str(FIXTURES / "internevo_7B_MoE4_sft.py"), "--run-dir", str(tmp_path / "ep1"),
                     "--set", *sets, "parallel.expert=1", f"ckpt.load_ckpt_info={info!r}"], nproc=2, timeout=600)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    assert losses == pytest.approx([r["loss"] for r in read_metrics(tmp_path / "ep1")], abs=1e-5)
