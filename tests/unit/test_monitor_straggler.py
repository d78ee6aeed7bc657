"""Straggler check in one process (the 2-rank version is in tests/dist/test_monitor_dist.py)."""

import socket

import pytest

from internlm_core.monitor.straggler import (StragglerMonitor, build_straggler_monitor, device_benchmark,
                                             diagnose_stragglers)


def test_single_process_reports_itself():
    r = diagnose_stragglers(0.5, 1.1, step=10)
    assert (r.ranks, r.hosts, r.times, r.stragglers) == ([0], [socket.gethostname()], {"step_time": [0.5]}, [])
    assert r.format() == "step 10: no straggler among 1 rank(s) (step_time mean 0.5000 s max 0.5000 s)"


def test_monitor_sums_timer_keys_and_falls_back_to_wall_time():
    m = StragglerMonitor(interval=3, time_keys=("fwd", "bwd"), bench=False)
    m.on_train_start(None)
    for step in range(1, 4):
        m.on_step_end(None, {"step": step, "fwd": 0.1, "bwd": 0.2})
    assert m.last_report.times == {"fwd": [pytest.approx(0.3)], "bwd": [pytest.approx(0.6)]}
    wall = StragglerMonitor(interval=2, bench=False)  # default keys time/...: absent from these records
    wall.on_train_start(None)
    wall.on_step_end(None, {"step": 1})
    assert wall.last_report is None
    wall.on_step_end(None, {"step": 2})
    assert list(wall.last_report.times) == ["step_time"] and wall.last_report.step == 2


def test_bench_and_build():
    assert device_benchmark(size=64, iters=2) > 0
    class Data:
        empty_cache_and_diag_interval = 0
        diag_outlier_ratio = 1.3
    assert build_straggler_monitor(Data()) is None
    Data.empty_cache_and_diag_interval = 50
    m = build_straggler_monitor(Data(), rank=1)
    assert (m.interval, m.outlier_ratio, m.rank) == (50, 1.3, 1)
