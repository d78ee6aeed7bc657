"""Monitors with a real 2-process gloo group: a crash on one rank ends both, stragglers, stop agreement."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.webhook_receiver import WebhookReceiver

REPO = Path(__file__).resolve().parents[2]

WORKER = r'''
import json, os, signal, sys, time
from pathlib import Path
import torch
import torch.distributed as dist

mode, out, url = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)

from internlm_core.monitor import (AlertManager, ExceptionMonitor, StopController, StragglerMonitor, WebhookSink)
from internlm_core.utils.logging import setup_logging

setup_logging(rank=rank, run_dir=out)

if mode == "crash":
    alerts = AlertManager([WebhookSink(url)], job_name="distcrash", rank=rank, timeout=5)
    with ExceptionMonitor(alerts, rank=rank, run_dir=out, job_name="distcrash", world_size=2):
        dist.barrier()
        if rank == 1:
            time.sleep(0.5)
            raise RuntimeError("injected failure on rank 1")
        dist.all_reduce(torch.ones(4))  # rank 0 waits here for a peer that will never come
    raise SystemExit("unreachable")

# mode == "loop": straggler check, stop file and signal agreement, DTensor byte counts
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from internlm_core.utils.memory import parameter_bytes, tensor_bytes

result = {}
mesh = init_device_mesh("cpu", (2,))
lin = torch.nn.Linear(8, 8, bias=False)
lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(0)]))
result["dtensor_param_bytes"] = parameter_bytes(lin)
result["dtensor_bytes"] = tensor_bytes([distribute_tensor(torch.zeros(16, 4), mesh, [Shard(0)])])

stop = StopController(out / "stop_file", rank=rank, signals=(signal.SIGTERM, signal.SIGUSR1))
diag = StragglerMonitor(interval=2, outlier_ratio=1.5, rank=rank, time_keys=("time/fwd", "time/cal_loss"))
if rank == 0:
    (out / "stop_file").write_text("-2")   # save (only) at step 2
dist.barrier()
diag.on_train_start(None)
decisions = []
for step in range(1, 20):
    t0 = time.perf_counter()
    time.sleep(0.02 if rank == 0 else 0.25)  # rank 1 computes slowly
    fwd = time.perf_counter() - t0
    if rank == 1 and step == 4:
        os.kill(os.getpid(), signal.SIGUSR1)
    # only rank 1 times the loss, as only the last stage does under pipeline parallel
    diag.on_step_end(None, {"step": step, "time/fwd": fwd, **({"time/cal_loss": 0.01} if rank == 1 else {})})
    d = stop.poll(step)
    decisions.append([step, d.save, d.stop, d.reason])
    if d.stop:
        break
stop.close()
r = diag.last_report
result.update(decisions=decisions, report=r.format(), hosts=r.hosts, measures=sorted(r.times),
              compute_stragglers=[s.rank for s in r.stragglers if s.measure == "time/fwd"],
              report_step=r.step, cal_loss=r.times["time/cal_loss"])
(out / f"result{rank}.json").write_text(json.dumps(result))
dist.destroy_process_group()
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, mode, url="http://127.0.0.1:9/none"):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, PYTHONPATH=str(REPO), RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script), mode, str(tmp_path), url], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def wait_all(procs, timeout):
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], outs


def test_exception_on_rank1_ends_both_ranks_and_alerts(tmp_path):
    with WebhookReceiver() as rx:
        t0 = time.monotonic()
        procs = launch(tmp_path, "crash", rx.url)
        codes, outs = wait_all(procs, timeout=60)
        took = time.monotonic() - t0
        bodies = rx.wait_for(3, timeout=5)
    assert codes == [1, 1], outs
    assert took < 60
    by_title = {b["title"]: b for b in bodies}
    crash = by_title["[ERROR] distcrash: rank 1 failed: RuntimeError"]
    assert crash["rank"] == 1 and crash["job"] == "distcrash" and crash["host"] == socket.gethostname()
    assert f"Exception on rank 1 on {crash['host']}:" in crash["content"]
    assert 'raise RuntimeError("injected failure on rank 1")' in crash["content"]
    assert "RuntimeError: injected failure on rank 1" in crash["content"]
    assert "[INFO] distcrash: training started" in by_title  # rank 0's start notice
    # rank 0 fails in its all_reduce once rank 1 is gone, and reports that itself
    peer = [b for b in bodies if b["rank"] == 0 and b["level"] == "error"]
    assert len(peer) == 1 and "all_reduce" in peer[0]["content"]
    assert "injected failure on rank 1" in (tmp_path / "crash_rank1.txt").read_text()
    assert "all_reduce" in (tmp_path / "crash_rank0.txt").read_text()


def test_stragglers_stop_file_and_signal_agreement(tmp_path):
    codes, outs = wait_all(launch(tmp_path, "loop"), timeout=90)
    assert codes == [0, 0], outs
    r0, r1 = (json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(2))
    # local shards of DTensors: half of 8x8 and of 16x4 float32 on each rank
    assert r0["dtensor_param_bytes"] == r1["dtensor_param_bytes"] == 4 * 8 * 4
    assert r0["dtensor_bytes"] == r1["dtensor_bytes"] == 8 * 4 * 4
    # rank 0 alone read the file; rank 1 got the value through the all_reduce
    reason = f"stop file {tmp_path / 'stop_file'}: -2"
    for r in (r0, r1):
        saves = [d for d in r["decisions"] if d[1]]
        assert saves[0] == [2, True, False, reason]
    # the signal reached rank 1 only; both stopped at the same step
    assert r1["decisions"][-1] == [4, True, True, "SIGUSR1 received"]
    assert r0["decisions"][-1] == [4, True, True, "SIGUSR1 received by another rank"]
    assert len(r0["decisions"]) == len(r1["decisions"]) == 4
    # rank 1's timed section takes 0.25 s per step against 0.02 s: it is the straggler in both ranks' reports
    assert r0["report_step"] == r1["report_step"] == 4
    assert r0["measures"] == ["bench", "time/cal_loss", "time/fwd"]
    assert r0["cal_loss"][0] is None and r0["cal_loss"][1] > 0  # compared among the ranks that time it
    assert r0["compute_stragglers"] == r1["compute_stragglers"] == [1]
    assert r0["hosts"] == [socket.gethostname()] * 2
    assert f"rank 1 ({socket.gethostname()}) time/fwd 0.5" in r0["report"]
    assert "straggler(s) slower than 1.5x the mean" in r0["report"]
