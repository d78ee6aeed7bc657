"""train.py killed with SIGKILL and started again: auto_resume continues the loss trajectory bitwise; a process killed
while a checkpoint is being written leaves the previous one usable; a model-only load starts a fresh schedule."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from internlm_core.checkpoint import MARKER, LocalStorage, latest_checkpoint
from tests.helpers.ckpt_faults import ENV as FAULT_ENV
FAULT_SCRIPT = "tests/helpers/ckpt_faults.py"  # train.py with the faults of FAULT_ENV injected
from tests.helpers.launch import read_metrics, run_train

pytestmark = pytest.mark.slow

STEPS = 20
SEQ = 64  # short rows: resuming does not depend on the shape


def train_args(run: Path, ckpt: Path, *extra: str) -> list[str]:
    return ["--config", "configs/tiny.py", "--run-dir", str(run), "--set", f"data.total_steps={STEPS}",
            f"data.seq_len={SEQ}", "data.valid_every=0", "monitor.tensorboard=False", "monitor.log_every=5", "ckpt.enable_save_ckpt=True",
            f"ckpt.save_ckpt_folder={ckpt}", "ckpt.checkpoint_every=5", *extra]


def output(p) -> str:
    return p.stdout[-3000:] + p.stderr[-3000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of STEPS steps: {step: loss}, and its checkpoint folder."""
    d = tmp_path_factory.mktemp("reference")
    p = run_train(train_args(d / "run", d / "ckpt"))
    assert p.returncode == 0, output(p)
    recs = read_metrics(d / "run")
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    return {r["step"]: r["loss"] for r in recs}, d / "ckpt"


def killed_run(tmp_path: Path, fault: str):
    p = run_train(train_args(tmp_path / "killed", tmp_path / "ckpt"), extra_env={FAULT_ENV: fault}, script=FAULT_SCRIPT)
    assert p.returncode == -signal.SIGKILL, output(p)
    return p


def resumed_run(tmp_path: Path):
    q = run_train(train_args(tmp_path / "resumed", tmp_path / "ckpt"))
    assert q.returncode == 0, output(q)
    return q, read_metrics(tmp_path / "resumed")


def test_sigkill_after_checkpoint_then_auto_resume_is_bitwise(tmp_path, reference):
    ref, _ = reference
    killed_run(tmp_path, "kill_after_commit@10")
    assert [r["step"] for r in read_metrics(tmp_path / "killed")] == list(range(1, 11))
    q, resumed = resumed_run(tmp_path)
    assert f"loaded {tmp_path / 'ckpt/10'} (step 10, regular" in q.stdout
    assert [r["step"] for r in resumed] == list(range(11, STEPS + 1))
    assert [r["loss"] for r in resumed] == [ref[s] for s in range(11, STEPS + 1)]  # bitwise: float equality
    assert resumed[-1]["num_consumed_tokens"] == STEPS * (2 * 2) * SEQ  # micro_num x micro_bsz rows


@pytest.mark.parametrize("fault", ["kill_before_metadata@10", "kill_before_marker@10"])
def test_killed_while_writing_keeps_previous_checkpoint(tmp_path, reference, fault):
    ref, _ = reference
    killed_run(tmp_path, fault)
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "5" / MARKER).is_file()
    assert list((ckpt / "10").glob("__0_*.distcp")) and not (ckpt / "10" / MARKER).exists()
    assert (ckpt / "10" / ".metadata").exists() == (fault.startswith("kill_before_marker"))
    assert latest_checkpoint(LocalStorage(ckpt)).name == "5"

    q, resumed = resumed_run(tmp_path)
    assert f"loaded {ckpt / '5'} (step 5, regular" in q.stdout
    assert [r["step"] for r in resumed] == list(range(6, STEPS + 1))
    assert [r["loss"] for r in resumed] == [ref[s] for s in range(6, STEPS + 1)]
    marker = json.loads((ckpt / "10" / MARKER).read_text())  # rewritten by the resumed run
    assert marker["step"] == 10 and LocalStorage(ckpt).verify("10", marker) is None


def test_model_only_load_starts_fresh_optimizer_and_schedule(tmp_path, reference):
    ref, ref_ckpt = reference
    info = f"ckpt.load_ckpt_info={{'path': '{ref_ckpt / str(STEPS)}', 'content': ('model',)}}"
    p = run_train(train_args(tmp_path / "run", tmp_path / "ckpt", info, "ckpt.auto_resume=False", "data.total_steps=5",
                             f"lr_scheduler.total_steps={STEPS}"))
    assert p.returncode == 0, output(p)
    assert f"loaded {ref_ckpt / str(STEPS)} (step {STEPS}, regular; content model)" in p.stdout
    recs = read_metrics(tmp_path / "run")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]  # a fresh train state and data position
    assert recs[0]["num_consumed_tokens"] == (2 * 2) * SEQ
    ref_lr = [json.loads(line)["lr"] for line in (ref_ckpt.parent / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in recs] == ref_lr[:5]  # the warm-up starts again
    assert recs[0]["loss"] < ref[1] - 1.0  # but the weights are the trained ones
