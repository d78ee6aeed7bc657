"""parallel.fault_tolerance in one process: the section's rules, the heal's state (a fresh FSDP model and optimizer
take a trained one's shards through torchft's own serialization and then step bit for bit like it), the gradient
buckets, and a lighthouse that is not configured. The groups themselves: tests/e2e/test_fault_tolerance.py."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from internlm_core.config import load_config
from internlm_core.errors import ConfigError
from internlm_core.parallel.fault_tolerance import HealState, _buckets, build_replica_groups
from internlm_core.trainer.state import TrainState
from tests.helpers.launch import ROOT, env

FT = "parallel.fault_tolerance"


def load(*overrides: str):
    return load_config("configs/tiny.py", [f"{FT}.enable=True", f"{FT}.group_size=2", *overrides])


@pytest.mark.parametrize("override, message", [
    ("group_size=0", "parallel.fault_tolerance.group_size: expected the number of replica groups (>= 1), got 0"),
    ("replica_id=2", "parallel.fault_tolerance.replica_id: expected 0 .. group_size - 1 = 1, got 2"),
    ("min_replicas=3", "parallel.fault_tolerance.min_replicas: expected 1 .. group_size = 2, got 3"),
    ("quorum_timeout=0", "parallel.fault_tolerance.quorum_timeout: expected seconds > 0, got 0.0"),
    ("max_retries=-1", "parallel.fault_tolerance.max_retries: expected an integer >= 0, got -1"),
    ("lighthouse='host:29510'", "parallel.fault_tolerance.lighthouse: expected the lighthouse's URL, e.g. "
                                "http://host:29510, got 'host:29510'"),
    ("replicas=2", "unknown config key 'parallel.fault_tolerance.replicas'"),
])
def test_bad_values_name_the_key_and_what_was_expected(override, message):
    with pytest.raises(ConfigError) as e:
        load(f"{FT}.{override}")
    assert message in str(e.value)


def test_spike_rewind_is_refused_with_replica_groups():
    """Each group judges its own share's loss: one group rewinding alone left the groups with different weights
    (seen: 2 groups, garbage data in group 0's share only; every tensor differed at the end)."""
    with pytest.raises(ConfigError, match=r"^configs/tiny.py: monitor.spike_rewind: not with "
                                          r"parallel.fault_tolerance \(2 replica groups\): each group judges the "
                                          r"loss of its own share"):
        load("monitor.spike_rewind=True", "monitor.loss_spike_ratio=1.3")
    assert load_config("configs/tiny.py", [f"{FT}.enable=True", "monitor.spike_rewind=True",
                                           "monitor.loss_spike_ratio=1.3"]).monitor.spike_rewind  # one group


def test_the_section_off_checks_nothing_and_on_keeps_its_values():
    assert not load_config("configs/tiny.py", [f"{FT}.replica_id=5"]).parallel.fault_tolerance.enable
    ft = load(f"{FT}.replica_id=1", f"{FT}.lighthouse=http://127.0.0.1:29510").parallel.fault_tolerance
    assert (ft.replica_id, ft.group_size, ft.min_replicas, ft.lighthouse) == (1, 2, 1, "http://127.0.0.1:29510")


def test_no_lighthouse_anywhere_is_a_config_error(monkeypatch):
    pytest.importorskip("torchft")
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    ft = load().parallel.fault_tolerance
    with pytest.raises(ConfigError, match=r"parallel.fault_tolerance.lighthouse: not set, and TORCHFT_LIGHTHOUSE is "
                                          r"not in the environment"):
        build_replica_groups(ft, 0, 1, torch.device("cpu"), heal=None, step=0)  # type: ignore[arg-type]


def test_buckets_keep_one_dtype_and_the_byte_limit():
    ts = [torch.zeros(4), torch.zeros(4), torch.zeros(8), torch.zeros(2, dtype=torch.float64), torch.zeros(3)]
    sizes = [[t.numel() for t in b] for b in _buckets(ts, max_bytes=32)]
    assert sizes == [[4, 4], [8], [2], [3]]  # 16 + 16 bytes fit; 32 more do not; a dtype change starts a bucket
    assert [len(b) for b in _buckets([torch.zeros(100)], max_bytes=8)] == [1]  # one larger tensor: its own bucket


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _fsdp_model(mesh, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _as_sent(state: dict) -> dict:
    """Through torchft's HTTP transport's serialization (torch.distributed's streaming save and load)."""
    from torch.distributed._serialization import _streaming_load, _streaming_save
    buf = io.BytesIO()
    _streaming_save(state, buf)
    buf.seek(0)
    return _streaming_load(buf, weights_only=False)


def test_a_fresh_group_takes_a_peers_shards_and_steps_like_it(one_rank_group):
    xs = [torch.randn(5, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    live, live_opt = _fsdp_model(one_rank_group, seed=0)
    for x in xs[:2]:
        _step(live, live_opt, x)
    live_state, fresh_state = TrainState(), TrainState()
    live_state.batch_count, live_state.step_count = 2, 2
    fresh, fresh_opt = _fsdp_model(one_rank_group, seed=1)  # other weights, no optimizer state yet
    assert not fresh_opt.state

    sent = _as_sent(HealState(live, live_opt, {"train_state": live_state, "absent": None}).state_dict())
    assert all(not isinstance(v, DTensor) for v in sent["model"].values())  # local shards on the wire
    HealState(fresh, fresh_opt, {"train_state": fresh_state}).load_state_dict(sent)
    assert (fresh_state.batch_count, fresh_state.step_count) == (2, 2)
    for x in xs[2:]:
        _step(live, live_opt, x)
        _step(fresh, fresh_opt, x)
    for a, b in zip(live.parameters(), fresh.parameters()):
        assert isinstance(b, DTensor) and torch.equal(a.to_local(), b.to_local())
    sa, sb = live_opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    for i in sa:
        assert isinstance(sb[i]["exp_avg"], DTensor)
        assert all(torch.equal(torch.as_tensor(sa[i][k].to_local() if isinstance(sa[i][k], DTensor) else sa[i][k]),
                               torch.as_tensor(sb[i][k].to_local() if isinstance(sb[i][k], DTensor) else sb[i][k]))
                   for k in sa[i])


RECORD = """#!/usr/bin/env python3
import json, os, sys
json.dump({"args": sys.argv[1:], "env": dict(os.environ)}, open(os.environ["RECORD_TO"], "w"))
"""


def test_the_sbatch_starts_one_group_per_node_that_a_lost_node_does_not_end(tmp_path):
    """tools/slurm/train_ft.sbatch under a stand-in srun (what it hands to srun), then the command srun would run on
    the second node under a stand-in torchrun (what that node's group is told)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", RECORD), ("torchrun", RECORD), ("scontrol", "#!/bin/sh\nprintf 'gpu01\\ngpu02\\n'\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    e = {k: v for k, v in env().items() if not k.startswith("SLURM_")}
    e.update(PATH=f"{bin_dir}:{e['PATH']}", SLURM_SUBMIT_DIR=str(ROOT), SLURM_JOB_NAME="t", SLURM_JOB_ID="42",
             SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu[01-02]", RUN_DIR=str(tmp_path / "run"),
             TORCHFT_LIGHTHOUSE="http://gpu01:29510", RECORD_TO=str(tmp_path / "srun.json"))
    p = subprocess.run(["bash", str(ROOT / "tools/slurm/train_ft.sbatch"), "configs/7B.py", "--set", "a.b=1"],
                       cwd=tmp_path, env=e, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    srun = json.loads((tmp_path / "srun.json").read_text())
    assert srun["args"][:2] == ["--kill-on-bad-exit=0", "--cpu-bind=none"] and srun["args"][2:4][0] == "bash"
    payload, argv = srun["args"][4], srun["args"][5:]
    assert argv == ["train_ft", "--set", "a.b=1"]
    node = dict(srun["env"], SLURM_NODEID="1", PATH=f"{bin_dir}:{srun['env']['PATH']}",
                RECORD_TO=str(tmp_path / "torchrun.json"))
    assert subprocess.run(["bash", "-c", payload, *argv], env=node, timeout=60).returncode == 0
    torchrun = json.loads((tmp_path / "torchrun.json").read_text())
    assert torchrun["env"]["TORCHFT_LIGHTHOUSE"] == "http://gpu01:29510"
    assert torchrun["args"] == [
        "--standalone", "--nproc_per_node", "8", "--max-restarts", "3", "train.py", "--config", "configs/7B.py",
        "--run-dir", f"{tmp_path}/run/group1", "--set", "a.b=1", "--set", "parallel.fault_tolerance.enable=True",
        "parallel.fault_tolerance.replica_id=1", "parallel.fault_tolerance.group_size=2",
        "parallel.fault_tolerance.min_replicas=1"]


def test_torchft_is_called_from_a_thread_whose_current_device_is_the_ranks(monkeypatch):
    """CUDA's current device is per thread and a new thread is on GPU 0; torchft's start_quorum hands the caller's
    current device to the thread that connects the replica communicator, should_commit synchronizes its stream.
    The thread that calls them (a daemon, so that SIGTERM can end the wait) sets the rank's device first."""
    from internlm_core.parallel import fault_tolerance
    from internlm_core.utils.accelerators import bind_thread_device

    events = []
    monkeypatch.setattr(torch.accelerator, "set_device_index",
                        lambda index: events.append(("set", index, threading.get_ident())))

    def start_quorum():
        events.append(("torchft", None, threading.get_ident()))
        return "quorum"

    waiter = fault_tolerance._LeaveOnSigterm(0, torch.device("cuda", 3))
    try:
        assert waiter.wait(start_quorum, "its quorum") == "quorum"
    finally:
        signal.signal(signal.SIGTERM, waiter._previous)
    assert [e[:2] for e in events] == [("set", 3), ("torchft", None)]
    assert events[0][2] == events[1][2] != threading.get_ident()  # in the calling thread, not the main one

    events.clear()
    waiter = fault_tolerance._LeaveOnSigterm(0, torch.device("cpu"))
    try:
        waiter.wait(start_quorum, "its quorum")
    finally:
        signal.signal(signal.SIGTERM, waiter._previous)
    assert [e[:2] for e in events] == [("torchft", None)]  # gloo on the CPU: no current device to set
    with pytest.raises(ValueError, match=r"expected a device with an index \(cuda:N\), got cuda"):
        bind_thread_device(torch.device("cuda"))
