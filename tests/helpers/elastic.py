"""Elastic runs as a user starts them (torchrun agents on loopback), and a worker killed from outside, as a node
failure kills it: SIGKILL, no warning, in the middle of a step."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from tests.helpers.launch import ROOT, env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(x) for x in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(x.decode(errors="replace").split("=", 1) for x in raw if b"=" in x)


def last_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "train":
            steps.append(rec["step"])
    return max(steps, default=0)


def agent(args: list[str], *, nnodes: int, nproc: int, port: int, run_id: str, max_restarts: int,
          log: Path, script: str = "train.py") -> subprocess.Popen:
    """One torchrun agent (`--standalone` when nnodes is 1) running `script` ARGS, its output into `log`."""
    rdzv = (["--standalone"] if nnodes == 1 else
            ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", run_id])
    cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, "--nproc_per_node", str(nproc),
           "--max-restarts", str(max_restarts), str(ROOT / script), *args]
    e = env()
    e["LOGLEVEL"] = "INFO"  # the agent says when it restarts the group
    return subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def kill_worker_after(agents: list[subprocess.Popen], run_dir: Path, step: int, rank: int,
                      timeout: float) -> Optional[int]:
    """SIGKILL the first-attempt worker of global rank `rank` once metrics.jsonl reaches `step`; its pid."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and all(a.poll() is None for a in agents):
        if last_step(run_dir) >= step:
            for a in agents:
                for pid in descendants(a.pid):
                    e = environ(pid)
                    if e.get("RANK") == str(rank) and e.get("TORCHELASTIC_RESTART_COUNT") == "0":
                        os.kill(pid, signal.SIGKILL)
                        return pid
        time.sleep(0.1)
    return None


def wait_all(agents: list[subprocess.Popen], timeout: float) -> list[int]:
    """Exit statuses of the agents; any still running after `timeout` is killed with its workers (status None)."""
    deadline = time.monotonic() + timeout
    codes = []
    for a in agents:
        try:
            codes.append(a.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(a.pid, signal.SIGKILL)
            a.wait()
            codes.append(None)
    return codes
