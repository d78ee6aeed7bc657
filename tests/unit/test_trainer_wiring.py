"""build_trainer's wiring: what a run records about its launch, and what a resume restores besides the model."""

import json
from pathlib import Path

import torch

from internlm_core.config import load_config
from internlm_core.distributed import LaunchInfo
from internlm_core.trainer.build import build_trainer

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = LaunchInfo("none", 0, 1, 0, torch.device("cpu"), None)


def build(tmp_path: Path, run: str, steps: int, *sets: str):
    cfg = load_config(ROOT / "configs/tiny.py", [
        f"data.total_steps={steps}", "data.valid_every=0", "monitor.log_every=1000", "model.num_layers=1",
        "data.seq_len=64", "ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder={tmp_path / 'ckpt'}",
        "ckpt.checkpoint_every=3", "monitor.loss_spike_ratio=5.0", *sets])
    (tmp_path / run).mkdir(parents=True, exist_ok=True)
    return build_trainer(cfg, LAUNCH, tmp_path / run)


def test_launch_record_and_resume_continues_tensorboard_and_loss_health(tmp_path):
    first = build(tmp_path, "a", 3)
    launch = json.loads((tmp_path / "a" / "launch.json").read_text())
    assert launch["launcher"] == "none" and launch["world_size"] == 1 and launch["argv"]
    assert launch["versions"]["torch"] == torch.__version__
    first.train()
    saved = first.health.state_dict()
    assert saved["good_steps"] == 3 and saved["ema"] == saved["ema"]  # a real running mean (not nan)

    second = build(tmp_path, "b", 5)  # auto_resume from step 3 into another run folder
    assert second.state.batch_count == 3
    assert second.health.state_dict() == saved
    # TensorBoard goes on in the first run's folder (InternLM's behaviour), metrics.jsonl in the new one
    assert second.writer._tb is not None and Path(second.writer._tb.log_dir) == tmp_path / "a" / "tensorboard"
    second.train()
    assert len(list((tmp_path / "a" / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert not (tmp_path / "b" / "tensorboard").exists()
