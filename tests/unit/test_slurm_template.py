"""tools/slurm/train.sbatch under a stand-in srun (what it hands to srun), the signal lead from a run's measured
step and checkpoint times, and the GPU a task trains on under one visible GPU per task."""

import json
import os
import subprocess
import sys

import pytest

from internlm_core.distributed.launch import cuda_device_index
from internlm_core.errors import LaunchError
from tests.helpers.launch import ROOT, env

# records its arguments and the rendezvous the tasks would get, starts nothing
FAKE_SRUN = """#!/usr/bin/env python3
import json, os, sys
json.dump({"args": sys.argv[1:], "MASTER_PORT": os.environ.get("MASTER_PORT")}, open(os.environ["FAKE_SRUN_LOG"], "w"))
"""


def run_sbatch(tmp_path, **slurm):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    e = {k: v for k, v in env().items() if not k.startswith("SLURM_") and k != "MASTER_PORT"}
    e.update(PATH=f"{bin_dir}{os.pathsep}{e['PATH']}", SLURM_SUBMIT_DIR=str(ROOT), SLURM_JOB_NAME="t",
             SLURM_JOB_ID="1234567", SLURM_NNODES="2", SLURM_NTASKS="16", SLURM_JOB_NODELIST="gpu[01-02]",
             RUN_DIR=str(tmp_path / "run"), FAKE_SRUN_LOG=str(tmp_path / "srun.json"), **slurm)
    p = subprocess.run(["bash", str(ROOT / "tools/slurm/train.sbatch"), "configs/7B.py", "--set", "data.total_steps=2"],
                       cwd=tmp_path, env=e, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout, json.loads((tmp_path / "srun.json").read_text())


def test_sbatch_passes_cpus_per_task_and_a_port_below_the_ephemeral_range(tmp_path):
    out, srun = run_sbatch(tmp_path, SLURM_CPUS_PER_TASK="12")
    args = srun["args"]
    assert args[:3] == ["--kill-on-bad-exit=1", "--cpu-bind=none", "--cpus-per-task=12"]
    assert args[3:] == ["python", "train.py", "--config", "configs/7B.py", "--launcher", "slurm", "--run-dir",
                        str(tmp_path / "run"), "--set", "data.total_steps=2"]
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    port = int(srun["MASTER_PORT"])
    assert port == 20000 + 1234567 % min(10000, low - 20000) and 20000 <= port < low
    assert f"rendezvous port {port}" in out


def test_sbatch_without_cpus_per_task_and_with_a_chosen_port(tmp_path):
    _, srun = run_sbatch(tmp_path, MASTER_PORT="29511")
    assert not any(a.startswith("--cpus-per-task") for a in srun["args"])
    assert srun["MASTER_PORT"] == "29511"


def test_requeued_job_prints_the_signal_lead_its_last_attempt_needed(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "rank0.log").write_text(
        "2026-12-03 INFO [rank0] internlm_core.checkpoint.writer: checkpoint local:/ckpt/100 complete: step 100, "
        "28000.0 MB in 95.40 s (training blocked 3.100 s)\n"
        "... checkpoint local:/ckpt/200 complete: step 200, 28000.0 MB in 130.25 s (training blocked 2.900 s)\n")
    (run / "metrics.jsonl").write_text("\n".join(json.dumps({"kind": "train", "step": i, "step_time": t})
                                                 for i, t in ((1, 9.5), (2, 1.6), (3, 1.5))) + "\n")
    out, _ = run_sbatch(tmp_path)
    # 1.5 x (9.5 + 130.25) + 60 = 269.6 -> 270
    assert "slowest step 9.5 s, slowest checkpoint 130.2 s (2 saves): #SBATCH --signal=USR1@270" in out
    p = subprocess.run([sys.executable, "tools/slurm/signal_lead.py", str(tmp_path)], cwd=ROOT, env=env(),
                       capture_output=True, text=True)
    assert p.returncode == 1 and "no complete checkpoint" in p.stderr


@pytest.mark.parametrize("local_rank,visible,index", [(0, 8, 0), (5, 8, 5), (5, 1, 0), (0, 1, 0), (3, 4, 3)])
def test_the_gpu_of_a_task(local_rank, visible, index):
    """torchrun / SLURM with the node's GPUs visible: the local rank; --gpus-per-task=1: the one GPU it sees."""
    assert cuda_device_index(local_rank, visible) == index


def test_a_task_without_a_gpu_is_a_launch_error(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(LaunchError, match=r"local rank 3 has no GPU: this process sees 2 \(CUDA_VISIBLE_DEVICES=0,1\)"):
        cuda_device_index(3, 2)
