"""tools/ft_local.sh with stand-ins for torchrun and the lighthouse (what it hands each group): every group its own
slice of the visible GPUs, `{group}` replaced by the group's index, each group's end reported. The real run (CPU,
gloo): tests/e2e/test_ft_local.py."""

import json
import os
import shutil
import subprocess

import pytest

from tests.helpers.launch import ROOT, env

# records what one group was given, and fails with status 3 for the group FAIL_GROUP names
FAKE_TORCHRUN = """#!/usr/bin/env python3
import json, os, sys
args = sys.argv[1:]
group = args[args.index("--run-dir") + 1].rsplit("group", 1)[1]
with open(os.path.join(os.environ["FAKE_LOG_DIR"], f"group{group}.json"), "w") as f:
    json.dump({"args": args, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}, f)
if group == os.environ.get("FAIL_GROUP"):
    print("ConfigError: ckpt.save_ckpt_folder: held by another run (its LEASE)")
    sys.exit(3)
"""
FAKE_LIGHTHOUSE = """#!/bin/sh
exec sleep 60
"""


def run(tmp_path, **environ):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("torchrun", FAKE_TORCHRUN), ("torchft_lighthouse", FAKE_LIGHTHOUSE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    e = {k: v for k, v in env().items() if k != "CUDA_VISIBLE_DEVICES"}
    e.update(PYTHON=str(bin_dir / "python"), RUN_DIR=str(tmp_path / "run"), FAKE_LOG_DIR=str(tmp_path),
             PATH=f"{bin_dir}{os.pathsep}{e['PATH']}", **environ)
    p = subprocess.run(["bash", str(ROOT / "tools/ft_local.sh"), "configs/tiny.py", "--set",
                        "ckpt.save_ckpt_folder=RUN/ckpt/group{group}", "data.total_steps=2"],
                       cwd=ROOT, env=e, capture_output=True, text=True, timeout=60)
    groups = {}
    for g in range(4):
        path = tmp_path / f"group{g}.json"
        if path.exists():
            groups[g] = json.loads(path.read_text())
    return p, groups


def test_each_group_gets_its_own_gpus_and_its_own_values(tmp_path):
    p, groups = run(tmp_path, REPLICA_GROUPS="2", NPROC="2", CUDA_VISIBLE_DEVICES="4,5,6,7")
    assert p.returncode == 0, p.stdout + p.stderr
    assert {g: v["CUDA_VISIBLE_DEVICES"] for g, v in groups.items()} == {0: "4,5", 1: "6,7"}
    for g, v in groups.items():
        assert f"ckpt.save_ckpt_folder=RUN/ckpt/group{g}" in v["args"]
        assert f"parallel.fault_tolerance.replica_id={g}" in v["args"]
    assert "group 0: ended (status 0)" in p.stdout and "group 1: ended (status 0)" in p.stdout


@pytest.mark.parametrize("visible", ["0,1,2", None])
def test_fewer_gpus_than_ranks_is_refused_and_no_gpu_slices_nothing(tmp_path, visible):
    if visible is None and shutil.which("nvidia-smi"):
        pytest.skip("a machine with nvidia-smi: the script slices its GPUs")
    gpus = {"CUDA_VISIBLE_DEVICES": visible} if visible else {}
    p, groups = run(tmp_path, REPLICA_GROUPS="2", NPROC="2", **gpus)
    if visible:
        assert p.returncode == 2 and groups == {}
        assert "REPLICA_GROUPS=2 x NPROC=2 ranks need as many GPUs, 3 are visible (0 1 2)" in p.stderr
    else:  # a CPU machine (no nvidia-smi here): every group runs without a GPU list
        assert p.returncode == 0 and [v["CUDA_VISIBLE_DEVICES"] for v in groups.values()] == [None, None]


def test_a_group_that_fails_is_reported_with_its_status_and_last_line(tmp_path):
    p, _ = run(tmp_path, REPLICA_GROUPS="2", NPROC="1", FAIL_GROUP="1")
    assert p.returncode == 3
    assert ("group 1: FAILED (status 3): ConfigError: ckpt.save_ckpt_folder: held by another run (its LEASE)"
            in p.stderr)
    assert "group 0: ended (status 0)" in p.stdout
