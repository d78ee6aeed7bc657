"""One live writer per checkpoint folder: a second run is refused with one line naming the first; a stale lease, a
dead holder on this host or the same job restarted takes it over; a run that lost its lease commits nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from internlm_core.checkpoint import LEASE, MARKER, CheckpointManager, Lease, LocalStorage
from internlm_core.checkpoint.lease import Holder, process_start_time
from internlm_core.config import load_config
from internlm_core.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[2]


def other_run(folder: Path, *, pid: int, host: str | None = None, heartbeat_age: float = 0.0,
              jobs: tuple[str, ...] = ()) -> None:
    """A LEASE as another process wrote it."""
    import socket
    import time
    start = process_start_time(pid)
    holder = Holder(host or socket.gethostname(), pid, start, list(jobs), "/runs/first", "train.py ...",
                    "2026-01-01T00:00:00+0000", time.time() - heartbeat_age)
    folder.mkdir(parents=True, exist_ok=True)
    from dataclasses import asdict
    (folder / LEASE).write_text(json.dumps(asdict(holder)))


@pytest.fixture
def alive():
    """A live process of this host that is not this one."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p.pid
    p.kill()
    p.wait()


def test_second_run_is_refused_naming_the_first(tmp_path, alive):
    other_run(tmp_path, pid=alive, heartbeat_age=3)
    with pytest.raises(CheckpointError) as e:
        Lease(LocalStorage(tmp_path), 120).acquire()
    msg = str(e.value)
    assert msg.startswith(f"ckpt.save_ckpt_folder {tmp_path} is in use by another run (pid {alive} on host ")
    assert "run folder /runs/first, holding it since 2026-01-01T00:00:00+0000, last heartbeat 3 s ago)" in msg
    assert msg.endswith("its lease is free once its heartbeat is older than ckpt.lease_timeout (120 s)")
    assert json.loads((tmp_path / LEASE).read_text())["pid"] == alive  # untouched


def test_taken_over_when_stale_when_its_holder_is_gone_or_when_it_is_the_same_job(tmp_path, alive, monkeypatch):
    other_run(tmp_path, pid=alive, heartbeat_age=200)  # alive but silent for longer than the timeout
    lease = Lease(LocalStorage(tmp_path), 120, settle_s=0)
    lease.acquire()
    assert lease.held and json.loads((tmp_path / LEASE).read_text())["pid"] == os.getpid()
    lease.release()
    assert not (tmp_path / LEASE).exists()

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    other_run(tmp_path, pid=int(dead.stdout), heartbeat_age=1)  # a process of this host that is gone
    assert Lease(LocalStorage(tmp_path), 120, settle_s=0).free_because(Lease(LocalStorage(tmp_path), 120).read()) == (
        f"its process {int(dead.stdout)} on this host is gone")

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")  # an elastic restart: the agent ended the old workers
    other_run(tmp_path, pid=alive, host="node-b", heartbeat_age=1, jobs=("torchelastic:run-7",))
    lease = Lease(LocalStorage(tmp_path), 120, settle_s=0)
    lease.acquire()
    assert json.loads((tmp_path / LEASE).read_text())["jobs"] == ["torchelastic:run-7"]


def test_lost_lease_commits_nothing_and_stops_the_run(tmp_path, alive):
    cfg = load_config(ROOT / "configs/tiny.py", ["ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder={tmp_path}",
                                                 "ckpt.async_upload=False"]).ckpt
    m = CheckpointManager(cfg)
    model = torch.nn.Linear(4, 4)
    m.register_model(model)
    m.claim()
    m.save(1, "test")
    assert m.wait().ok and (tmp_path / "1" / MARKER).is_file()
    other_run(tmp_path, pid=alive)  # another run took the folder over (e.g. after our heartbeat stalled)
    m.save(2, "test")
    res = m.wait()
    assert not res.ok and not (tmp_path / "2" / MARKER).exists()
    assert f"this run lost its lease to pid {alive} on host" in res.error
    with pytest.raises(CheckpointError, match=f"{tmp_path}: this run lost the folder's lease to pid {alive} on host"):
        m.save(3, "test")
    with pytest.raises(CheckpointError):
        m.close()  # the last save failed; the lease is not ours to remove
    assert json.loads((tmp_path / LEASE).read_text())["pid"] == alive


def test_same_process_twice_and_no_lease_when_off(tmp_path):
    base = ["ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder={tmp_path}"]
    a = CheckpointManager(load_config(ROOT / "configs/tiny.py", base).ckpt)
    b = CheckpointManager(load_config(ROOT / "configs/tiny.py", base).ckpt)
    a.claim()
    b.claim()  # a second manager of the same process (tests, tools) is the same writer
    assert a.lease.held and b.lease.held
    off = CheckpointManager(load_config(ROOT / "configs/tiny.py", [*base, "ckpt.lease_timeout=0"]).ckpt)
    assert off.lease is None
    a.close()
    b.close()
    assert not (tmp_path / LEASE).exists()
