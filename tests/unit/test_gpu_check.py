"""tools/gpu_check.sh and bench/gpu_paths.py on a machine without a GPU: every row is listed, none passes, and the
exit status says the check is unproven (the rows themselves need a GPU: bench/gpu_rows.py)."""

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers.launch import ROOT, env, run_script

sys.path.insert(0, str(ROOT / "bench"))

import gpu_paths  # noqa: E402
import gpu_rows  # noqa: E402

PROMISED = [r.name for r in gpu_rows.ROWS if r.when is None]


def results(out):
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_dry_run_lists_every_row_and_exits_unproven(tmp_path):
    e = env()
    e["PY"] = sys.executable
    p = subprocess.run(["bash", str(ROOT / "tools/gpu_check.sh"), "--dry-run", str(tmp_path / "out")], cwd=ROOT,
                       env=e, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    rows = results(tmp_path / "out")
    assert [r["check"] for r in rows] == [r.name for r in gpu_rows.ROWS]  # every row, in order, as it finished
    assert {r["check"]: r["status"] for r in rows if r["check"] in PROMISED} == {n: "unproven" for n in PROMISED}
    for row in gpu_rows.ROWS:
        assert f"| {row.name} |" in p.stdout and f"| {row.name} |" in (tmp_path / "out/table.md").read_text()
    assert "UNPROVEN: a promised row did not run" in p.stdout
    # the accelerators' rows come first, and are promised only where their package imports
    assert [r.when for r in gpu_rows.ROWS[:3]] == ["flash_attn", "flash_attn", "apex"]
    assert "simulate 7B rank 0 of 8 on the GPU" in PROMISED and "async save + resume on CUDA" in PROMISED


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA reports")
def test_without_cuda_no_row_runs_and_none_passes(tmp_path):
    p = run_script("bench/gpu_paths.py", ["--out", str(tmp_path)], timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    rows = {r["check"]: r for r in results(tmp_path)}
    assert all(rows[n]["status"] == "unproven" and rows[n]["result"] == "no CUDA device: not run" for n in PROMISED)


def test_a_row_that_cannot_finish_in_the_time_left_does_not_start():
    row = gpu_rows.Row("x", lambda out: (True, "", ""), budget_s=60)
    assert gpu_paths.why_not_run(row, dry_run=False, cuda=True, left=59.0) == (
        "unproven", "time budget: 59 s left, the row needs up to 60 s; not run")
    assert gpu_paths.why_not_run(row, dry_run=False, cuda=True, left=61.0) is None
    assert gpu_paths.why_not_run(row, dry_run=False, cuda=False, left=600.0) == ("unproven", "no CUDA device: not run")


def test_only_every_promised_row_ok_passes(tmp_path):
    """The table of a finished run: 0 only when every promised row is ok (absent accelerator rows aside); a FAIL is
    1; a row the time cap cut off (never written) makes it unproven, 2."""
    def write(statuses):
        (tmp_path / "results.jsonl").write_text("".join(
            json.dumps({"check": n, "status": s, "result": "r", "detail": ""}) + "\n" for n, s in statuses.items()))
        return run_script("bench/gpu_paths.py", ["--table", str(tmp_path)], timeout=120)
    accelerators = {r.name: "absent" for r in gpu_rows.ROWS if r.when}
    p = write({**accelerators, **{n: "ok" for n in PROMISED}})
    assert p.returncode == 0 and "every promised row ran on the GPU and passed" in p.stdout
    p = write({**accelerators, **{n: "ok" for n in PROMISED}, PROMISED[2]: "FAIL"})
    assert p.returncode == 1 and f"| {PROMISED[2]} | FAIL | r |  |" in p.stdout
    p = write({**accelerators, **{n: "ok" for n in PROMISED[:-1]}})  # the last row never wrote
    assert p.returncode == 2 and f"| {PROMISED[-1]} | UNPROVEN | not run (time cap, or the run died) |  |" in p.stdout
    assert gpu_paths.exit_status([]) == 2  # nothing ran: nothing is proven


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(ROOT / "tools/gpu_check.sh")]).returncode == 0
