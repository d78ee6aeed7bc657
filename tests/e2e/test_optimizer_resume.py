"""train.py with the WSD schedule, with Muon and with multi-token prediction, stopped and resumed as a user would: bitwise the uninterrupted run.
The WSD job is planned to decay at step 10, stopped at step 4, resumed with lr_scheduler.decay_start_step=6 (cool down
earlier, the issue's "decay start settable for a running job") across the decay start to step 8, and resumed again
inside the decay: every loss and lr equals a run that planned step 6 from the start."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.launch import read_metrics, run_train

pytestmark = pytest.mark.slow

SCHEDULE = 12  # lr_scheduler.total_steps: the jobs below stop earlier (data.total_steps) on the same schedule


def args(run: Path, ckpt: Path, steps: int, *extra: str) -> list[str]:
    return ["--config", "configs/tiny.py", "--run-dir", str(run), "--set", f"data.total_steps={steps}",
            f"lr_scheduler.total_steps={SCHEDULE}", "data.seq_len=64", "data.valid_every=0",
            "monitor.tensorboard=False", "ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder={ckpt}",
            "ckpt.checkpoint_every=100", *extra]


def train(tmp: Path, name: str, steps: int, *extra: str) -> tuple[list[dict], str]:
    p = run_train(args(tmp / name, tmp / "ckpt", steps, *extra))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return read_metrics(tmp / name), p.stdout + p.stderr


def by_step(records: list[dict], key: str) -> dict:
    return {r["step"]: r[key] for r in records}


WSD = ["lr_scheduler.name=wsd", "lr_scheduler.decay_shape=linear"]


def test_wsd_resume_with_a_new_decay_start_is_bitwise(tmp_path):
    ref, _ = train(tmp_path / "ref", "run", SCHEDULE, *WSD, "lr_scheduler.decay_start_step=6")
    lr = by_step(ref, "lr")
    assert lr[2] == lr[6] == 3e-3 and lr[7] < lr[6] and lr[12] < lr[8]  # stable to step 6, then the decay
    jobs = tmp_path / "jobs"
    first, _ = train(jobs, "a", 4, *WSD, "lr_scheduler.decay_start_step=10")
    second, out = train(jobs, "b", 8, *WSD, "lr_scheduler.decay_start_step=6")
    assert "(step 4, regular" in out
    third, out = train(jobs, "c", SCHEDULE, *WSD, "lr_scheduler.decay_start_step=6")
    assert "(step 8, regular" in out and "in the decay that starts at step 6" in out
    resumed = second + third
    assert [r["step"] for r in resumed] == list(range(5, SCHEDULE + 1))
    for key in ("loss", "lr", "grad_norm"):
        assert by_step(resumed, key) == {s: v for s, v in by_step(ref, key).items() if s > 4}, key


def test_muon_resume_is_bitwise(tmp_path):
    muon = ["optimizer.name=muon"]
    ref, out = train(tmp_path / "ref", "run", 8, *muon)
    assert "optimizer: Muon for 14 matrices of the blocks" in out
    adamw, _ = train(tmp_path / "adamw", "run", 8)
    assert by_step(adamw, "loss")[8] != by_step(ref, "loss")[8]
    jobs = tmp_path / "jobs"
    train(jobs, "a", 4, *muon)
    resumed, out = train(jobs, "b", 8, *muon)
    assert "(step 4, regular" in out
    assert by_step(resumed, "loss") == {s: v for s, v in by_step(ref, "loss").items() if s > 4}


def test_mtp_resume_is_bitwise(tmp_path):
    """model.mtp's depths (their blocks, norms and projections) are in the checkpoint: a job stopped at step 3 and
    resumed trains steps 4-6 with the uninterrupted run's loss and mtp_loss."""
    mtp = ["model.mtp={'depth': 2, 'loss_weight': 0.3}"]
    ref, _ = train(tmp_path / "ref", "run", 6, *mtp)
    jobs = tmp_path / "jobs"
    train(jobs, "a", 3, *mtp)
    resumed, out = train(jobs, "b", 6, *mtp)
    assert "(step 3, regular" in out
    for key in ("loss", "mtp_loss", "grad_norm"):
        assert by_step(resumed, key) == {s: v for s, v in by_step(ref, key).items() if s > 3}, key
