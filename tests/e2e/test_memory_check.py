"""train.py refuses a run that cannot fit before it allocates (estimate/fit.py); --force and the warn band run."""

import re
import subprocess
import sys
import time

import psutil
import pytest

from internlm_core.config import load_config
from internlm_core.estimate import GiB
from internlm_core.estimate.fit import memory_need
from tests.helpers.launch import ROOT, env, read_metrics, run_train

pytestmark = pytest.mark.slow


# A child started from this process by vfork+exec (what subprocess does) inherits this process's peak resident set
# in its ru_maxrss: Linux records the old address space's high-water mark at exec. In a full pytest run that is
# gigabytes. A small wrapper forks the real child, so the figure it reports is the child's own.
_OWN_PEAK = ("import os, subprocess, sys; p = subprocess.Popen(sys.argv[1:]); _, s, u = os.wait4(p.pid, 0); "
             "print(f'OWN_PEAK_RSS_KIB {u.ru_maxrss}', flush=True); sys.exit(os.waitstatus_to_exitcode(s) or 0)")


def test_7B_is_refused_within_seconds_without_a_large_allocation(tmp_path):
    """configs/7B.py as is on this machine (~180 GiB estimated on a CPU): one line naming both numbers and a layout
    that fits, a non-zero exit within seconds, and a resident set far below the need (no materialization)."""
    args = [sys.executable, str(ROOT / "train.py"), "--config", "configs/7B.py", "--run-dir", str(tmp_path)]
    if psutil.virtual_memory().available > 150 * GiB:  # a bigger machine than the 24 GiB this was written on
        args += ["--set", "memory_limit_gib=24"]
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", _OWN_PEAK, *args], cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    out = p.stdout
    seconds = time.monotonic() - t0
    assert p.returncode != 0, out[-3000:]
    lines = [line for line in out.splitlines() if "ConfigError: memory:" in line]
    assert len(lines) == 1, out[-3000:]
    m = re.search(r"puts this process at ([\d.]+) GiB per device \(cpu, \+/-15%\) but ([\d.]+) GiB is free "
                  r"\((host RAM available|memory_limit_gib=24|the memory cgroup's limit less its usage)\); "
                  r"layouts that fit: (\d+) devices with parallel\.zero1=-1 model\.checkpoint=True", lines[0])
    assert m, lines[0]
    need = float(m.group(1))
    assert need > 150 and float(m.group(2)) < need
    assert 'train.py --force or memory_check="warn" runs anyway' in lines[0]
    peak = int(re.findall(r"^OWN_PEAK_RSS_KIB (\d+)$", out, re.M)[-1]) * 1024
    assert peak < 2 * GiB and peak < need * GiB / 50, peak  # measured here: 0.3 GiB
    assert seconds < 60, seconds  # measured here: 6 s, most of it imports


def _tiny_need(sets):
    return memory_need(load_config("configs/tiny.py", sets, world_size=1), 1, "cpu")


@pytest.mark.parametrize("force,factor,expected", [
    (True, 0.25, 'running anyway (memory_check="warn")'),       # cannot fit, --force: warns and runs
    (False, 1.0, "within the estimator's error: it may run out of memory"),  # at the limit: warns and runs
])
def test_force_and_the_warn_band_run(tmp_path, force, factor, expected):
    sets = ["data.total_steps=2", "data.valid_every=0", "monitor.tensorboard=False"]
    limit = _tiny_need(sets) * factor / GiB
    args = ["--config", "configs/tiny.py", "--run-dir", str(tmp_path), *(["--force"] if force else []),
            "--set", *sets, f"memory_limit_gib={limit}"]
    p = run_train(args)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert expected in (tmp_path / "rank0.log").read_text()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_refused_without_force(tmp_path):
    sets = ["data.total_steps=2", "monitor.tensorboard=False"]
    limit = _tiny_need(sets) * 0.25 / GiB
    p = run_train(["--config", "configs/tiny.py", "--run-dir", str(tmp_path), "--set", *sets,
                   f"memory_limit_gib={limit}"])
    assert p.returncode != 0
    assert f"is free (memory_limit_gib={limit:g}); " in p.stdout + p.stderr
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "config.yaml").exists()
