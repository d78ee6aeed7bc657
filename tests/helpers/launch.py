"""Run train.py / torchrun as a user would, in a subprocess, from the repository root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")
    # a fixed MFU denominator instead of ~1 s of matmuls at the start of every run (utils/peak.py)
    e.setdefault("INTERNLM_CORE_PEAK_TFLOPS", "0.05")
    e.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see tests/conftest.py
    return e


def run_train(args: list[str], nproc: int = 1, timeout: float = 300, script: str = "train.py",
              extra_env: dict | None = None, fresh: bool = False) -> subprocess.CompletedProcess:
    """`python train.py ARGS`, or ARGS on `nproc` ranks as torchrun starts them, forked from a warm interpreter
    (tests/helpers/warm.py: same argv, environment, output and exit status, without the ~6 s of imports).
    fresh=True starts real processes (`python` / `torchrun --standalone`): memory measurements, and the tests of
    torchrun itself."""
    e = env()
    if extra_env:
        e.update(extra_env)
    if not fresh:
        from tests.helpers import warm
        return warm.run(str(ROOT / script), args, e, ROOT, timeout, nproc=nproc)
    if nproc == 1:
        cmd = [sys.executable, str(ROOT / script), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(ROOT / script), *args]
    return subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)


def run_script(script: str, args: list[str], timeout: float = 300, extra_env: dict | None = None
               ) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` from the repository root (a tool; "-m MODULE" for `python -m MODULE ARGS`), forked
    from the warm interpreter."""
    e = env()
    if extra_env:
        e.update(extra_env)
    from tests.helpers import warm
    return warm.run(script if script.startswith("-m ") else str(ROOT / script), args, e, ROOT, timeout)


def read_metrics(run_dir: Path, kind: str = "train") -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]
