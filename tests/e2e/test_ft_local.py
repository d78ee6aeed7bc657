"""tools/ft_local.sh as a user runs it (CPU, gloo, the tiny config): a lighthouse and two torchrun jobs, each a
replica group. `{group}` in an option becomes the group's index, so two groups that save checkpoints train to the
end, each into its own folder; SIGTERM to the script stops everything it started (the lighthouse, the torchrun
agents and their workers) and leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.elastic import descendants, free_port
from tests.helpers.ft import train_records
from tests.helpers.launch import ROOT, env

pytest.importorskip("torchft", reason="parallel.fault_tolerance needs torchft (requirements-dev.txt)")
pytestmark = pytest.mark.slow


def ft_local(tmp_path: Path, steps: int, *options: str) -> subprocess.Popen:
    e = env()
    e.pop("CUDA_VISIBLE_DEVICES", None)
    e.update(REPLICA_GROUPS="2", NPROC="1", MAX_RESTARTS="0", RUN_DIR=str(tmp_path / "run"),
             LIGHTHOUSE_PORT=str(free_port()), STOP_TIMEOUT="40")
    args = ["--set", f"data.total_steps={steps}", "data.seq_len=64", "data.micro_num=1", "data.valid_every=0",
            "monitor.tensorboard=False", "monitor.log_every=100", "parallel.fault_tolerance.timeout=10",
            "parallel.fault_tolerance.quorum_timeout=30", *options]
    return subprocess.Popen(["bash", str(ROOT / "tools/ft_local.sh"), "configs/tiny.py", *args], cwd=ROOT, env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def test_two_groups_with_checkpoints_each_in_its_own_folder_train_to_the_end(tmp_path):
    proc = ft_local(tmp_path, 6, "ckpt.enable_save_ckpt=True", "ckpt.checkpoint_every=3",
                    f"ckpt.save_ckpt_folder={tmp_path}/ckpt/group{{group}}")
    out = finish(proc, 400)
    assert proc.returncode == 0, out[-4000:]
    assert "group 0: ended (status 0)" in out and "group 1: ended (status 0)" in out
    for g in (0, 1):
        recs = train_records(tmp_path / "run" / f"group{g}")
        assert recs and recs[-1]["step"] == 6 and recs[-1]["ft/replica_id"] == g, out[-4000:]
        folder = tmp_path / "ckpt" / f"group{g}"
        # a group that joins late heals from the other past step 3 and saves step 6 only: which one does is timing
        saved = sorted(p.parent.name for p in folder.glob("*/COMPLETE"))
        assert "6" in saved and set(saved) <= {"3", "6"}, sorted(folder.rglob("*"))
    assert not (tmp_path / "ckpt" / "group{group}").exists()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_to_the_script_stops_every_process_it_started(tmp_path):
    proc = ft_local(tmp_path, 100000)
    try:
        deadline = time.monotonic() + 300
        runs = [tmp_path / "run" / f"group{g}" for g in (0, 1)]
        while not all(train_records(r) for r in runs):  # both groups are training
            assert proc.poll() is None and time.monotonic() < deadline, finish(proc, 10)[-4000:]
            time.sleep(0.2)
        started = descendants(proc.pid)
        # the lighthouse, two torchrun agents and a worker below each (the workers are in sessions of their own)
        assert len(started) >= 5, started
        proc.send_signal(signal.SIGTERM)
        out = finish(proc, 120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, out[-4000:]
    assert "SIGTERM: stopping every group and the lighthouse" in out
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in started if _alive(p)] == []
