"""tools/slurm/train.sbatch and train_elastic.sbatch under a stand-in srun (what they hand to srun), the signal lead
from a run's measured step and checkpoint times, and the GPU a task trains on under one visible GPU per task."""

import json
import os
import subprocess
import sys

import pytest

import torch

from internlm_core.distributed.launch import (cuda_device_index, init_distributed, isolated_gpu_warning, local_device,
                                              tasks_on_node)
from internlm_core.errors import LaunchError
from tests.helpers.launch import ROOT, env

# records its arguments and the rendezvous the tasks would get, starts nothing
FAKE_SRUN = """#!/usr/bin/env python3
import json, os, sys
json.dump({"args": sys.argv[1:], "MASTER_PORT": os.environ.get("MASTER_PORT"),
           "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}, open(os.environ["FAKE_SRUN_LOG"], "w"))
"""


# the elastic script asks scontrol for the first node of the allocation
FAKE_SCONTROL = """#!/bin/sh
printf 'gpu01\\ngpu02\\n'
"""


def run_sbatch(tmp_path, script="train.sbatch", **slurm):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    e = {k: v for k, v in env().items()
         if not k.startswith("SLURM_") and k not in ("MASTER_PORT", "RDZV_PORT", "PYTORCH_CUDA_ALLOC_CONF")}
    e.update(PATH=f"{bin_dir}{os.pathsep}{e['PATH']}", SLURM_SUBMIT_DIR=str(ROOT), SLURM_JOB_NAME="t",
             SLURM_JOB_ID="1234567", SLURM_NNODES="2", SLURM_NTASKS="16", SLURM_JOB_NODELIST="gpu[01-02]",
             RUN_DIR=str(tmp_path / "run"), FAKE_SRUN_LOG=str(tmp_path / "srun.json"), **slurm)
    p = subprocess.run(["bash", str(ROOT / "tools/slurm" / script), "configs/7B.py", "--set", "data.total_steps=2"],
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


def test_elastic_sbatch_passes_cpus_per_task_and_a_port_below_the_ephemeral_range(tmp_path):
    out, srun = run_sbatch(tmp_path, "train_elastic.sbatch", SLURM_CPUS_PER_TASK="96")
    args = srun["args"]
    assert args[:4] == ["--kill-on-bad-exit=1", "--cpu-bind=none", "--cpus-per-task=96", "torchrun"]
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    port = 20000 + 1234567 % min(10000, low - 20000)
    assert 20000 <= port < low
    assert args[args.index("--rdzv-endpoint") + 1] == f"gpu01:{port}" and f"rendezvous gpu01:{port}" in out
    assert args[args.index("--rdzv-id") + 1] == "1234567"
    assert args[-7:] == ["train.py", "--config", "configs/7B.py", "--run-dir", str(tmp_path / "run"), "--set",
                         "data.total_steps=2"]


def test_elastic_sbatch_without_cpus_per_task_and_with_a_chosen_port(tmp_path):
    _, srun = run_sbatch(tmp_path, "train_elastic.sbatch", RDZV_PORT="29511")
    assert not any(a.startswith("--cpus-per-task") for a in srun["args"])
    assert srun["args"][srun["args"].index("--rdzv-endpoint") + 1] == "gpu01:29511"


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


@pytest.mark.parametrize("device_type,local_rank,visible,device", [
    ("cuda", 5, 1, "cuda:0"), ("cuda", 5, 8, "cuda:5"), ("cuda", 0, 1, "cuda:0"), ("cpu", 5, 0, "cpu")])
def test_the_device_a_process_trains_on(device_type, local_rank, visible, device):
    assert local_device(device_type, local_rank, visible) == torch.device(device)


@pytest.mark.parametrize("visible,device", [(1, "cuda:0"), (8, "cuda:5")])
def test_init_distributed_takes_the_gpu_a_task_sees(monkeypatch, visible, device):
    """SLURM --gpus-per-task=1: local rank 5 sees one GPU, which is cuda:0 (cuda:5 was "invalid device ordinal");
    with the node's 8 GPUs visible it is cuda:5. The visible count stands in for the hardware this machine lacks."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for key, value in {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "5"}.items():
        monkeypatch.setenv(key, value)
    info = init_distributed(launcher="none", device_type="cuda")
    assert info.device == torch.device(device) and chosen == [torch.device(device)]


@pytest.mark.parametrize("script", ["train.sbatch", "train_elastic.sbatch", "train_ft.sbatch"])
def test_every_template_runs_the_tasks_with_expandable_allocator_segments(tmp_path, script):
    """MoE's varying expert rows fragment a caching allocator of fixed blocks; the user's own setting is kept."""
    extra = {"TORCHFT_LIGHTHOUSE": "http://gpu01:29510"} if script == "train_ft.sbatch" else {}
    _, srun = run_sbatch(tmp_path, script, **extra)
    assert srun["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    _, srun = run_sbatch(tmp_path, script, PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:512", **extra)
    assert srun["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"


def test_the_template_keeps_every_gpu_of_the_node_visible_to_every_task():
    text = (ROOT / "tools/slurm/train.sbatch").read_text()
    sbatch = [line.split("#", 2)[1] for line in text.splitlines() if line.startswith("#SBATCH")]
    assert any(line.startswith("SBATCH --gpus-per-node=") for line in sbatch)
    assert not any("gpus-per-task" in line or "gpu-bind" in line for line in sbatch)
    assert "fine too" not in text and "NCCL loses P2P/NVLink" in text


@pytest.mark.parametrize("environ, tasks", [
    ({}, 1), ({"LOCAL_WORLD_SIZE": "4"}, 4), ({"SLURM_NTASKS_PER_NODE": "8"}, 8),
    ({"SLURM_TASKS_PER_NODE": "8(x2)"}, 8), ({"SLURM_TASKS_PER_NODE": "2,1"}, 2)])
def test_the_tasks_on_a_node(environ, tasks):
    assert tasks_on_node(environ) == tasks


@pytest.mark.parametrize("tasks, visible, warns", [(8, 1, True), (8, 8, False), (1, 1, False), (2, 4, False)])
def test_a_task_confined_to_one_gpu_of_a_shared_node_is_warned_about(tasks, visible, warns):
    message = isolated_gpu_warning(tasks, visible)
    assert (message is not None) is warns
    if warns:
        assert message.startswith(f"this process sees 1 GPU while {tasks} processes of the job run on its node")
        assert "NCCL cannot use P2P/NVLink" in message and "--gpus-per-node" in message


def test_init_distributed_warns_about_one_visible_gpu_among_eight_tasks(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    for key, value in {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(key, value)
    with caplog.at_level("WARNING"):
        init_distributed(launcher="none", device_type="cuda")
    assert "this process sees 1 GPU while 8 processes of the job run on its node" in caplog.text


# runs what srun was given on "node" SLURM_NODEID (its options dropped), with the stand-ins first on PATH
RUNNING_SRUN = """#!/usr/bin/env python3
import os, sys
args = sys.argv[1:]
while args and args[0].startswith("--"):
    args.pop(0)
os.environ["PATH"] = os.path.dirname(os.path.abspath(__file__)) + os.pathsep + os.environ["PATH"]
os.execvp(args[0], args)
"""
FAKE_TORCHRUN = """#!/usr/bin/env python3
import json, os, sys
json.dump(sys.argv[1:], open(os.environ["FAKE_TORCHRUN_LOG"], "w"))
"""


@pytest.mark.parametrize("node", [0, 1])
def test_ft_sbatch_gives_each_group_its_own_values_through_the_group_placeholder(tmp_path, node):
    """`{group}` in a train.py option becomes the node's replica group index (FIRST_REPLICA + SLURM_NODEID): the
    groups can save checkpoints, each into its own folder (one live writer per folder)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", RUNNING_SRUN), ("torchrun", FAKE_TORCHRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    e = {k: v for k, v in env().items() if not k.startswith("SLURM_")}
    e.update(PATH=f"{bin_dir}{os.pathsep}{e['PATH']}", SLURM_SUBMIT_DIR=str(ROOT), SLURM_JOB_NAME="t",
             SLURM_JOB_ID="7", SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu[01-02]", SLURM_NODEID=str(node),
             FIRST_REPLICA="2", REPLICA_GROUPS="4", TORCHFT_LIGHTHOUSE="http://gpu01:29510",
             RUN_DIR=str(tmp_path / "run"), FAKE_TORCHRUN_LOG=str(tmp_path / "torchrun.json"))
    p = subprocess.run(["bash", str(ROOT / "tools/slurm/train_ft.sbatch"), "configs/7B.py", "--set",
                        "ckpt.save_ckpt_folder=/ckpt/7B/group{group}", "data.total_steps=2"],
                       cwd=tmp_path, env=e, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    args = json.loads((tmp_path / "torchrun.json").read_text())
    g = 2 + node
    assert args[args.index("--run-dir") + 1] == str(tmp_path / "run" / f"group{g}")
    assert f"ckpt.save_ckpt_folder=/ckpt/7B/group{g}" in args and f"parallel.fault_tolerance.replica_id={g}" in args
    assert not any("{group}" in a for a in args)
