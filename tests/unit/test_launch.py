"""Launcher: SLURM node lists as `scontrol show hostnames` expands them, SLURM → torch variables, detection."""

import pytest

import torch

from internlm_core.distributed import detect_launcher, expand_nodelist, init_simulated, slurm_env_to_torch
from internlm_core.errors import LaunchError


@pytest.mark.parametrize("nodelist,hosts", [
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("gpu5", ["gpu5"]),
    ("a,b", ["a", "b"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),       # padding from the range start
    ("node[008-010]", ["node008", "node009", "node010"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),  # product, in order
    ("sh[3]-ib,x[1,5]", ["sh3-ib", "x1", "x5"]),
    ("10.0.0.[7-8]", ["10.0.0.7", "10.0.0.8"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist,message", [
    ("node[01-03", "unbalanced brackets"),
    ("node[1-[2]]", "unbalanced or nested brackets"),
    ("node[a-c]", "'a-c' is not a number or a range like 01-03"),
    ("node[5-3]", "range '5-3' runs backwards"),
    ("", "no host names in it"),
])
def test_expand_nodelist_errors(nodelist, message):
    with pytest.raises(LaunchError, match=message.replace("[", r"\[")):
        expand_nodelist(nodelist)


def test_slurm_env_to_torch():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "node[01-03,07],gpu5", "SLURM_JOB_ID": "123456"}
    assert slurm_env_to_torch(env) == {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1",
                                       "MASTER_ADDR": "node01", "MASTER_PORT": str(29500 + 3456)}
    # MASTER_ADDR / MASTER_PORT set by the job script win
    env.update(MASTER_ADDR="10.1.2.3", MASTER_PORT="40000")
    out = slurm_env_to_torch(env)
    assert (out["MASTER_ADDR"], out["MASTER_PORT"]) == ("10.1.2.3", "40000")
    # SLURM_NODELIST is the older name
    assert slurm_env_to_torch({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "h[2-3]"})["MASTER_ADDR"] == "h2"


@pytest.mark.parametrize("env,message", [
    ({"SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "a"}, "environment variable SLURM_PROCID is not set"),
    ({"SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "a"}, "environment variable SLURM_NTASKS is not set"),
    ({"SLURM_PROCID": "x", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "a"}, "SLURM_PROCID='x' is not an integer"),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "a"}, r"SLURM_PROCID 2 is outside \[0, SLURM_NTASKS=2\)"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "neither MASTER_ADDR nor SLURM_JOB_NODELIST is set"),
])
def test_slurm_env_errors(env, message):
    with pytest.raises(LaunchError, match=message):
        slurm_env_to_torch(env)


def test_detect_launcher():
    assert detect_launcher({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}) == "torch"
    assert detect_launcher({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}) == "slurm"
    assert detect_launcher({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == "none"  # one task: nothing to form
    assert detect_launcher({}) == "none"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without CUDA")
def test_a_simulated_rank_on_a_gpu_needs_one():
    """`train.py --simulate W --simulate-device cuda` on a machine without CUDA: a LaunchError before any group."""
    with pytest.raises(LaunchError, match="--simulate-device cuda: this machine has no usable CUDA device"):
        init_simulated(8, 0, device_type="cuda")
    with pytest.raises(LaunchError, match="--simulate-device: expected cpu or cuda, got 'tpu'"):
        init_simulated(8, 0, device_type="tpu")
