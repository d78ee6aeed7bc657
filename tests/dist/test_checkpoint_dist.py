"""Checkpoints under torchrun (gloo, 2 processes): SIGKILL and auto-resume bitwise with 2 data-parallel ranks.

Loading a checkpoint into another layout (weights and AdamW state exact, training on with the uninterrupted
losses) is the resharding matrix of tests/dist/test_parallel.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.launch import read_metrics, run_train

pytestmark = pytest.mark.slow

STEPS = 8
KILL = 4  # the step whose checkpoint commits just before the SIGKILL


def output(p) -> str:
    return p.stdout[-4000:] + p.stderr[-4000:]


def train_args(run: Path, ckpt: Path, *extra: str) -> list[str]:
    return ["--config", "configs/tiny.py", "--run-dir", str(run), "--set", f"data.total_steps={STEPS}",
            "data.seq_len=64", "data.valid_every=0", "monitor.tensorboard=False", "monitor.log_every=5",
            "ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder={ckpt}", "ckpt.checkpoint_every=2", *extra]


def test_two_ranks_sigkill_then_auto_resume_is_bitwise(tmp_path):
    from tests.helpers.ckpt_faults import ENV as FAULT_ENV
    ref = run_train(train_args(tmp_path / "ref", tmp_path / "ref_ckpt"), nproc=2)
    assert ref.returncode == 0, output(ref)
    ref_loss = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "ref")}
    assert sorted(ref_loss) == list(range(1, STEPS + 1))

    ckpt = tmp_path / "ckpt"
    p = run_train(train_args(tmp_path / "killed", ckpt), nproc=2, extra_env={FAULT_ENV: f"kill_after_commit@{KILL}"},
                  script="tests/helpers/ckpt_faults.py",
                  fresh=True)  # torchrun, as users meet it: it reports the killed worker
    assert p.returncode != 0 and "Signal 9 (SIGKILL)" in p.stdout + p.stderr, output(p)
    saved = ckpt / str(KILL)
    assert sorted(saved.glob("__*_0.distcp")) == [saved / "__0_0.distcp", saved / "__1_0.distcp"]
    meta = json.loads((saved / "meta.json").read_text())  # each data-parallel rank's loader state, recorded
    assert meta["layout"]["dp"] == 2 and meta["data_state"]["data"]["dp_ranks_agree"] is True
    assert {k: v["rows_consumed"] for k, v in meta["data_state"]["data"]["per_dp_rank"].items()} == \
        {"dp0": KILL * 2 * 2, "dp1": KILL * 2 * 2}

    q = run_train(train_args(tmp_path / "resumed", ckpt), nproc=2)
    assert q.returncode == 0, output(q)
    assert f"loaded {ckpt / str(KILL)} (step {KILL}, regular" in q.stdout and "same layout: exact resume" in q.stdout
    resumed = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(KILL + 1, STEPS + 1))
    assert [r["loss"] for r in resumed] == [ref_loss[s] for s in range(KILL + 1, STEPS + 1)]
    assert resumed[-1]["num_consumed_tokens"] == STEPS * 2 * (2 * 2) * 64  # steps x dp x micro_num x micro_bsz x seq


# ---- resharding: N processes save, M load -------------------------------------------------------------------------
