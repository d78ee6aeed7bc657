"""Monitoring through train.py as users run it: signals, the stop file, profilers, crashes and hangs."""

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import warm
from tests.helpers.webhook_receiver import WebhookReceiver
from tests.helpers.launch import ROOT, env, read_metrics, run_train

pytestmark = pytest.mark.slow


def start_train(run: Path, *overrides: str) -> warm.Started:
    """`python train.py ...` in the background (forked from the warm test interpreter, tests/helpers/warm.py)."""
    args = ["--config", "configs/tiny.py", "--run-dir", str(run), "--set", "data.valid_every=0", "monitor.log_every=1",
            *overrides]
    return warm.start(str(ROOT / "train.py"), args, env(), ROOT)


def wait_for_steps(run: Path, n: int, proc: warm.Started, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = run / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.output()
        time.sleep(0.1)
    raise AssertionError(f"no {n} steps within {timeout} s")


def complete_steps(folder: Path) -> list[int]:
    return sorted(int(p.parent.name) for p in folder.glob("*/COMPLETE"))


def test_sigterm_saves_a_checkpoint_and_exits_zero(tmp_path):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    proc = start_train(run, "data.total_steps=100000", "ckpt.enable_save_ckpt=True",
                       f"ckpt.save_ckpt_folder={ckpt}", "ckpt.checkpoint_every=100000")
    wait_for_steps(run, 5, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    last = read_metrics(run)[-1]["step"]
    assert last < 100000
    assert complete_steps(ckpt) == [last]  # saved exactly where it stopped, and complete
    assert "SIGTERM" in out


@pytest.mark.parametrize("value,stops", [(9, True), (-9, False)])
def test_stop_file_saves_at_the_step_and_quits_if_positive(tmp_path, value, stops):
    run, ckpt, stop = tmp_path / "run", tmp_path / "ckpt", tmp_path / "stop"
    proc = start_train(run, "data.total_steps=14", "ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder={ckpt}",
                       "ckpt.checkpoint_every=1000", "ckpt.save_at_end=False", f"ckpt.stop_file_path={stop}")
    wait_for_steps(run, 2, proc)  # the controller resets the file at start; request after that
    stop.write_text(str(value))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    steps = [r["step"] for r in read_metrics(run)]
    assert steps[-1] == (9 if stops else 14)
    assert complete_steps(ckpt) == [9]


def test_profiling_writes_a_trace_and_a_memory_report(tmp_path):
    run = tmp_path / "run"
    p = run_train(["--config", "configs/tiny.py", "--run-dir", str(run), "--profiling",
                   "--set", "data.total_steps=12", "data.valid_every=0"])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    traces = list((run / "profile").glob("*.pt.trace.json"))
    assert traces and json.loads(traces[0].read_text())["traceEvents"]
    report = json.loads((run / "memory_report.json").read_text())
    text = json.dumps(report)
    for key in ("parameters", "gradients", "optimizer"):
        assert key in text
    assert (run / "memory_report.txt").is_file()


def _find(report, key):
    if isinstance(report, dict):
        for k, v in report.items():
            if k == key:
                yield v
            yield from _find(v, key)
    elif isinstance(report, list):
        for v in report:
            yield from _find(v, key)


def test_profiling_memory_breakdown_is_nonzero(tmp_path):
    run = tmp_path / "run"
    p = run_train(["--config", "configs/tiny.py", "--run-dir", str(run), "--set", "data.total_steps=6",
                   "data.valid_every=0", "monitor.memory_report=True"])
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads((run / "memory_report.json").read_text())
    values = {k: [v for v in _find(report, k) if isinstance(v, (int, float))]
              for k in ("parameters", "gradients", "optimizer_state")}
    for k, vs in values.items():
        assert vs and max(vs) > 0, (k, report)


def run_fault(tmp_path: Path, kind: str, nproc: int, *overrides: str, timeout: float = 120):
    run = tmp_path / "run"
    train_args = ["--config", "configs/tiny.py", "--run-dir", str(run), "--set", "data.valid_every=0",
                  "JOB_NAME=faulty", *overrides]
    driver = str(ROOT / "tests/e2e/fault_driver.py")
    fault = [kind, "3", str(nproc - 1), "--"]
    t0 = time.monotonic()
    if nproc == 1:  # forked from the warm test interpreter
        p = run_train([*fault, *train_args], script="tests/e2e/fault_driver.py", timeout=timeout)
    else:  # torchrun, which ends the other rank when one fails
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               driver, *fault, *train_args]
        p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    return p, run, time.monotonic() - t0


def test_exception_on_one_of_two_ranks_alerts_and_ends_both(tmp_path):
    with WebhookReceiver() as rx:
        p, run, took = run_fault(tmp_path, "raise", 2, "data.total_steps=1000", f"monitor.alert.webhook_url={rx.url}",
                                 "--dist-timeout", "60")
        bodies = rx.wait_for(3, timeout=10)
    assert p.returncode != 0
    assert took < 110
    crash = [b for b in bodies if b["level"] == "error" and b["rank"] == 1]
    assert len(crash) == 1, bodies
    c = crash[0]
    assert c["job"] == "faulty" and c["host"] == socket.gethostname() and "faulty" in c["title"]
    assert "RuntimeError: injected failure on rank 1 at step 3" in c["content"]
    assert "fault_driver.py" in c["content"]  # the last traceback lines
    assert "injected failure on rank 1" in (run / "crash_rank1.txt").read_text()
    assert any(b["rank"] == 0 and "training started" in b["title"] for b in bodies)


def test_stalled_step_fires_the_watchdog_with_stacks_in_the_log(tmp_path):
    with WebhookReceiver() as rx:
        p, run, _ = run_fault(tmp_path, "stall", 1, "data.total_steps=5", "monitor.hang_timeout=3",
                              f"monitor.alert.webhook_url={rx.url}")
        bodies = rx.wait_for(3, timeout=10)
    assert p.returncode == 0, p.stderr[-2000:]
    assert any("hang" in (b["title"] + b["content"]).lower() for b in bodies), bodies
    log = (run / "rank0.log").read_text()
    assert "time.sleep(8)" in log and 'File "' in log  # the stalled thread's Python stack
