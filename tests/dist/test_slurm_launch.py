"""The SLURM launcher, driven by the variables srun sets, forms the same process group as torchrun.

Two local processes get SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID / SLURM_JOB_NODELIST / SLURM_JOB_ID
(no RANK, no MASTER_ADDR) as `srun --ntasks 2 python ...` would give them; the same probe then runs under
`torchrun --standalone --nproc_per_node 2`, and each rank's view of the group must be the same.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.helpers import warm
from tests.helpers.launch import ROOT, env as base_env, read_metrics

pytestmark = pytest.mark.slow

PROBE = r'''
import json, os, sys
import torch
import torch.distributed as dist
from internlm_core.distributed import ParallelDims, destroy_distributed, init_distributed

launch = init_distributed(timeout_s=60)          # launcher detected from the environment
dims = ParallelDims(world_size=launch.world_size, tp=2)
dims.build_mesh("cpu")
gathered = [None] * launch.world_size
dist.all_gather_object(gathered, {"rank": launch.rank, "local_rank": launch.local_rank})
x = torch.tensor([float(launch.rank + 1)])
dist.all_reduce(x)
tp = dims.group("tp")
y = torch.tensor([float(10 ** launch.rank)])
dist.all_reduce(y, group=tp)
open(os.path.join(sys.argv[1], f"rank{launch.rank}.json"), "w").write(json.dumps({
    "launcher": launch.launcher, "rank": launch.rank, "world_size": launch.world_size,
    "local_rank": launch.local_rank, "backend": launch.backend, "dist_rank": dist.get_rank(),
    "dist_world": dist.get_world_size(), "gathered": gathered, "sum": x.item(),
    "tp_ranks": dist.get_process_group_ranks(tp), "tp_rank": dims.tp_rank, "tp_sum": y.item(),
    "master": [os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]]}))
destroy_distributed()
'''

CLEARED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
           "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def free_port_in(lo: int, hi: int) -> int:
    """A free port in [lo, hi): the launcher derives its port as 29500 + SLURM_JOB_ID % 10000."""
    for port in range(lo, hi):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def slurm_env(procid: int, ntasks: int, job_id: int) -> dict:
    e = {k: v for k, v in base_env().items() if k not in CLEARED and not k.startswith("SLURM_")}
    e.update(SLURM_PROCID=str(procid), SLURM_NTASKS=str(ntasks), SLURM_LOCALID=str(procid),
             SLURM_JOB_NODELIST="127.0.0.[1-3],gpu5", SLURM_JOB_ID=str(job_id), SLURM_NODEID="0")
    return e


def run_srun_like(script: str, args: list[str], ntasks: int, job_id: int, timeout: float = 240
                  ) -> list[subprocess.CompletedProcess]:
    """`python SCRIPT ARGS` as `ntasks` tasks with the variables srun sets (forked from the warm test
    interpreter, tests/helpers/warm.py)."""
    procs = [warm.start(script, args, slurm_env(i, ntasks, job_id), ROOT) for i in range(ntasks)]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, out))
    return results


def probes(folder) -> list[dict]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]


def test_slurm_env_forms_the_same_group_as_torchrun(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    port = free_port_in(29600, 39000)
    (tmp_path / "slurm").mkdir()
    (tmp_path / "torchrun").mkdir()
    slurm = run_srun_like(str(script), [str(tmp_path / "slurm")], 2, job_id=port - 29500)
    for r in slurm:
        assert r.returncode == 0, r.stderr[-3000:]
    by_slurm = probes(tmp_path / "slurm")
    e = {k: v for k, v in base_env().items() if k not in CLEARED and not k.startswith("SLURM_")}
    tr = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                         str(script), str(tmp_path / "torchrun")], cwd=ROOT, env=e, capture_output=True, text=True,
                        timeout=240)
    assert tr.returncode == 0, tr.stderr[-3000:]
    by_torchrun = probes(tmp_path / "torchrun")

    assert [p["launcher"] for p in by_slurm] == ["slurm", "slurm"]
    assert [p["launcher"] for p in by_torchrun] == ["torch", "torch"]
    # master from the first host of the expanded node list; port from the job id
    assert all(p["master"] == ["127.0.0.1", str(port)] for p in by_slurm)
    for s, t in zip(by_slurm, by_torchrun):
        for k in ("launcher", "master"):
            s.pop(k), t.pop(k)
        assert s == t
    assert [p["rank"] for p in by_slurm] == [0, 1] and by_slurm[1]["local_rank"] == 1
    assert by_slurm[0]["sum"] == 3.0 and by_slurm[0]["tp_ranks"] == [0, 1] and by_slurm[1]["tp_sum"] == 11.0
    assert by_slurm[0]["gathered"] == [{"rank": 0, "local_rank": 0}, {"rank": 1, "local_rank": 1}]


FAKE_SRUN = r"""#!/usr/bin/env python3
# Stand-in for srun on one machine: start SLURM_NTASKS copies of the command with the variables srun sets.
import os, subprocess, sys
args = sys.argv[1:]
open(os.environ["FAKE_SRUN_LOG"], "w").write(" ".join(args))
while args and args[0].startswith("-"):
    args.pop(0)
n = int(os.environ["SLURM_NTASKS"])
procs = [subprocess.Popen(args, env={**os.environ, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)}) for i in range(n)]
sys.exit(max(p.wait() for p in procs))
"""


def test_sbatch_template_trains_under_srun(tmp_path):
    """tools/slurm/train.sbatch as sbatch would run it (a stand-in srun starts 2 local tasks): train.py with
    --launcher slurm trains data parallel, one metrics record per step, a log per rank."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    run = tmp_path / "run"
    port = free_port_in(29600, 39000)
    e = slurm_env(0, 2, job_id=port - 29500)
    e.update(PATH=f"{bin_dir}{os.pathsep}{e['PATH']}", SLURM_SUBMIT_DIR=str(ROOT), SLURM_JOB_NAME="t",
             SLURM_NNODES="1", RUN_DIR=str(run), FAKE_SRUN_LOG=str(tmp_path / "srun.args"))
    p = subprocess.run(["bash", str(ROOT / "tools/slurm/train.sbatch"), "configs/tiny.py", "--set",
                        "data.total_steps=2", "data.valid_every=0", "data.seq_len=64", "model.hidden_size=64",
                        "monitor.tensorboard=False", "parallel.zero1=-1"],
                       cwd=ROOT, env=e, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "job " in p.stdout and "2 tasks" in p.stdout
    assert (tmp_path / "srun.args").read_text().startswith("--kill-on-bad-exit=1")
    recs = read_metrics(run)
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[-1]["num_consumed_tokens"] == 2 * 2 * 2 * 2 * 64  # steps x dp x micro_num x micro_bsz x seq_len
    assert (run / "rank0.log").exists() and (run / "rank1.log").exists()
