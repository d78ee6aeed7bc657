"""Automatic rewind on a loss spike, through the real wiring (build_trainer): training data with one region of
garbage (batches 9 and 10 uniformly random tokens) spikes the loss; the run reloads the checkpoint before the spike,
skips those batches and trains on with bitwise the losses of a run told by hand (data.skip_batches="9-10");
the skipped batches are kept in its checkpoints and the rewind is marked in metrics.jsonl and alerted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from internlm_core.config import load_config
from internlm_core.distributed import LaunchInfo
from internlm_core.monitor.alert import AlertManager, FileSink
from internlm_core.trainer.build import build_trainer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
from fault_driver import inject_garbage  # noqa: E402

LAUNCH = LaunchInfo("none", 0, 1, 0, torch.device("cpu"), None)
STEPS = 14


def run(tmp_path: Path, name: str, *sets: str, garbage: bool = True) -> list[dict]:
    cfg = load_config(ROOT / "configs/tiny.py", [
        f"data.total_steps={STEPS}", "data.micro_num=1", "data.valid_every=0", "monitor.tensorboard=False", "monitor.log_every=1000",
        "ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder={tmp_path / name / 'ckpt'}", "ckpt.checkpoint_every=4",
        *sets])
    (tmp_path / name / "run").mkdir(parents=True)
    alerts = AlertManager([FileSink(tmp_path / name / "alerts.jsonl")], job_name=name)
    trainer = build_trainer(cfg, LAUNCH, tmp_path / name / "run", alerts=alerts)
    if garbage:
        inject_garbage(trainer, 9, 2)  # batches 9 and 10
    trainer.health.warmup_steps = 5  # spikes judged after 5 good steps (default 20), to keep the test short
    trainer.train()
    alerts.close()
    return [json.loads(line) for line in (tmp_path / name / "run/metrics.jsonl").read_text().splitlines()]


def last_losses(records: list[dict]) -> dict[int, float]:
    """The loss that counts for each step: a rewind (or restart) record at S voids the earlier records after S."""
    out: dict[int, float] = {}
    for r in records:
        if r["kind"] in ("rewind", "restart"):
            out = {s: v for s, v in out.items() if s <= r["step"]}
        elif r["kind"] == "train":
            out[r["step"]] = r["loss"]
    return out


def test_garbage_region_is_rewound_and_skipped_like_skip_batches_by_hand(tmp_path):
    rewound = run(tmp_path, "auto", "monitor.loss_spike_ratio=1.15", "monitor.spike_rewind=True",
                  "monitor.spike_rewind_steps=2")
    by_hand = run(tmp_path, "by_hand", "data.skip_batches=9-10", garbage=False)

    (rec,) = [r for r in rewound if r["kind"] == "rewind"]  # the garbage was seen: steps 10 and 11 spiked
    assert rec["step"] == 8 and rec["from_step"] == 11 and rec["skip_batches"] == [9, 10] and rec["rewind"] == 1
    spiked = [r["loss"] for r in rewound if r["kind"] == "train" and r["step"] in (10, 11)]
    assert min(spiked) > 1.3 * max(r["loss"] for r in by_hand if r["kind"] == "train" and r["step"] > 5)
    auto, hand = last_losses(rewound), last_losses(by_hand)
    assert sorted(auto) == sorted(hand) == [s for s in range(1, STEPS + 1) if s not in (10, 11)]
    assert auto == hand  # bitwise: the rewound run is the run that skipped the garbage from the start

    # nothing of the spike was saved, and the batches to skip are in the checkpoints (a restart skips them too)
    ckpt = tmp_path / "auto/ckpt"
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.is_dir()) == [4, 8, 12, STEPS]
    state = json.loads((ckpt / str(STEPS) / "meta.json").read_text())["state"]
    assert state["batch_skipper"] == {"skip_batches": [9, 10]} and state["spike_rewind"] == {"rewinds": 1}
    alerts = [json.loads(line) for line in (tmp_path / "auto/alerts.jsonl").read_text().splitlines()]
    (alert,) = [a for a in alerts if "rewound" in a["title"]]
    assert alert["title"] == "[WARNING] auto: rewound to step 8 after a loss spike"
    assert alert["content"].startswith(f"loss spike at steps 10-11: rewound to the checkpoint of step 8 "
                                       f"({ckpt / '8'}) in ")
    assert alert["content"].endswith("batches 9, 10 are skipped from now on (saved with every checkpoint); rewind 1 "
                                     "of at most 3")
