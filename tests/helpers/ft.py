"""Replica groups as a user runs them (parallel.fault_tolerance): a real torchft lighthouse process on loopback, and
each group's ranks started the way torchrun starts them (forked warm, tests/helpers/warm.py), killed from outside
the way a lost node kills them (SIGKILL, no warning)."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.helpers import warm
from tests.helpers.elastic import free_port
from tests.helpers.launch import ROOT, env

LIGHTHOUSE = Path(sys.executable).with_name("torchft_lighthouse")


def _die_with_parent() -> None:
    """In the lighthouse's process before it starts: SIGKILL it when the test process dies (Linux), so that a test
    run killed from outside leaves no lighthouse behind."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG


class Lighthouse:
    """`torchft_lighthouse` on a free loopback port, its output in `log`; `url` is what the groups are given."""

    def __init__(self, log: Path, min_replicas: int = 1, heartbeat_timeout_ms: int = 1000,
                 join_timeout_ms: int = 2000):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [str(LIGHTHOUSE), "--min_replicas", str(min_replicas), "--bind", f"127.0.0.1:{self.port}",
             "--heartbeat_timeout_ms", str(heartbeat_timeout_ms), "--join_timeout_ms", str(join_timeout_ms),
             "--quorum_tick_ms", "50"], stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # listening: a group that starts now finds it
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the lighthouse did not listen on {self.port} within 20 s: {log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_group(replica_id: int, nproc: int, args: list[str], script: str = "tests/e2e/ft_driver.py",
                extra_env: dict | None = None) -> list[warm.Started]:
    """The `nproc` ranks of one replica group (its own process group and store, as one torchrun job): `script`
    ARGS on each, with torchrun's environment; as torchrun's agent does, when one rank ends with a failure the
    others are stopped (SIGTERM): a group with a dead rank is gone as a whole."""
    port = free_port()
    ranks = []
    for rank in range(nproc):
        e = env()
        e.update(extra_env or {})
        e.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
                 GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0",
                 TORCHELASTIC_RUN_ID=f"ft-group{replica_id}-{port}")
        ranks.append(warm.start(str(ROOT / script), args, e, ROOT))
    threading.Thread(target=_stop_the_rest_on_failure, args=(ranks,), daemon=True).start()
    return ranks


def _stop_the_rest_on_failure(ranks: list[warm.Started]) -> None:
    while any(r.poll() is None for r in ranks):
        if any(r.poll() not in (None, 0) for r in ranks):
            for r in ranks:
                r.send_signal(signal.SIGTERM)  # only those still running
            return
        time.sleep(0.05)


def kill_group(ranks: list[warm.Started]) -> None:
    """SIGKILL every rank of a group, as a lost node ends them."""
    for r in ranks:
        if r.poll() is None:
            os.kill(r.pid, signal.SIGKILL)
    for r in ranks:
        r.wait(30)


def wait_group(ranks: list[warm.Started], timeout: float) -> tuple[list[int | None], str]:
    """Exit statuses of the ranks (None: still running after `timeout`, then killed) and their output."""
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for r in ranks:
        try:
            codes.append(r.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.kill(r.pid, signal.SIGKILL)
            r.wait(30)
            codes.append(None)
    return codes, "\n".join(r.communicate()[0][-6000:] for r in ranks)


def train_records(run_dir: Path) -> list[dict]:
    """The `train` records of a run folder's metrics.jsonl so far (a line being written is left out)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "train":
            out.append(rec)
    return out


def wait_for(predicate, timeout: float, what: str, alive: list[warm.Started]) -> None:
    """Poll `predicate` until it holds; AssertionError naming `what` after `timeout` or when a rank of `alive`
    ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        ended = [r for r in alive if r.poll() is not None]
        if ended:
            raise AssertionError(f"waiting for {what}: a rank ended with {ended[0].returncode}:\n"
                                 f"{ended[0].output()[-4000:]}")
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")
