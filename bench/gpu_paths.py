#!/usr/bin/env python
"""The GPU check's rows, run one after the other on one GPU; a row it promises either runs and passes, or the check
does not pass (run by tools/gpu_check.sh, which caps the whole at 7 minutes).

    python bench/gpu_paths.py --out OUT [--budget-s 400] [--dry-run]   # run (or list) the rows
    python bench/gpu_paths.py --table OUT                                # one table of OUT/results.jsonl

Every row is written to OUT/results.jsonl and printed as soon as it finishes. Status of a row:
  ok        it ran and its check held
  FAIL      it ran and its check did not hold, or it raised
  unproven  a promised row that did not run: no CUDA device, the time budget, --dry-run, a crash of the process
  absent    flash-attn's and apex's rows where the package is not importable (not promised on that machine)
Exit status (and --table's): 0 only when every promised row is ok; 1 when a row failed; 2 when none failed but
some promised row is unproven. A CPU machine therefore never passes: every row needs the GPU.

The rows themselves are in bench/gpu_rows.py; `ROWS` there lists them in order (flash-attn and apex first).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

RESULTS = "results.jsonl"
MARK = {"ok": "ok", "FAIL": "FAIL", "unproven": "UNPROVEN", "absent": "absent"}


def exit_status(statuses: list[str]) -> int:
    """0: every promised row ok; 1: a row failed; 2: none failed, some promised row did not run."""
    if "FAIL" in statuses:
        return 1
    return 2 if "unproven" in statuses or not statuses else 0


def record(out: Path, name: str, status: str, result: str, detail: str = "", seconds: float = 0.0) -> dict:
    """Append one row to OUT/results.jsonl and print it: each row is on disk the moment it finishes."""
    row = {"check": name, "status": status, "result": result, "detail": detail, "seconds": round(seconds, 1)}
    with open(out / RESULTS, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    print(f"{MARK[status]:9} {name:<44} {result}" + (f"  ({detail})" if detail else ""), flush=True)
    return row


def why_not_run(row, dry_run: bool, cuda: bool, left: float) -> tuple[str, str] | None:
    """(status, reason) when `row` is not to run here and now; None when it runs."""
    if row.when and importlib.util.find_spec(row.when) is None:
        return "absent", f"{row.when} is not importable here (not promised)"
    if dry_run:
        return "unproven", "dry run: not run"
    if row.cuda and not cuda:
        return "unproven", "no CUDA device: not run"
    if left < row.budget_s:
        return "unproven", f"time budget: {left:.0f} s left, the row needs up to {row.budget_s} s; not run"
    return None


def run(out: Path, budget_s: float, dry_run: bool, only: list[str]) -> int:
    """Run (or, dry, list) every row in order; returns the exit status."""
    import gpu_rows
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULTS).write_text("")
    start = time.monotonic()
    cuda = False if dry_run else gpu_rows.cuda_available()
    statuses = []
    for row in gpu_rows.ROWS:
        if only and row.name not in only:
            continue
        skip = why_not_run(row, dry_run, cuda, budget_s - (time.monotonic() - start))
        if skip is not None:
            statuses.append(record(out, row.name, skip[0], skip[1])["status"])
            continue
        t0 = time.monotonic()
        try:
            ok, result, detail = row.fn(out)
            status = "ok" if ok else "FAIL"
        except Exception as e:  # one broken path must not hide the others
            status, result = "FAIL", f"{type(e).__name__}: {e}"[:300]
            detail = traceback.format_exc().strip().splitlines()[-3][:200]
        statuses.append(record(out, row.name, status, result, detail, time.monotonic() - t0)["status"])
        gpu_rows.release_memory()
    return exit_status(statuses)


def table(out: Path) -> int:
    """One markdown table of the rows in OUT/results.jsonl; a promised row missing there (the time cap ended the
    run, or the process died) is unproven."""
    import gpu_rows
    rows = [json.loads(line) for line in (out / RESULTS).read_text().splitlines() if line.strip()] \
        if (out / RESULTS).exists() else []
    seen = {r["check"] for r in rows}
    for row in gpu_rows.ROWS:
        if row.name not in seen:
            absent = row.when and importlib.util.find_spec(row.when) is None
            rows.append({"check": row.name, "status": "absent" if absent else "unproven",
                         "result": "not importable here" if absent else "not run (time cap, or the run died)",
                         "detail": ""})
    print("\n| check | status | result | detail |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['check']} | {MARK[r['status']]} | {r['result']} | {r['detail']} |")
    status = exit_status([r["status"] for r in rows if r["status"] != "absent"])
    verdict = {0: "every promised row ran on the GPU and passed", 1: "FAILED: a row did not hold",
               2: "UNPROVEN: a promised row did not run"}[status]
    print(f"\n{verdict}")
    return status


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="folder for results.jsonl and the rows' runs")
    p.add_argument("--table", type=Path, help="print the table of a finished (or capped) run's folder and exit")
    p.add_argument("--budget-s", type=float, default=400.0,
                   help="seconds for all rows (a row that may not finish in what is left does not start)")
    p.add_argument("--dry-run", action="store_true", help="list every row as unproven without running any")
    p.add_argument("--only", nargs="*", default=[], help="run only these rows (by name; the others are not listed)")
    a = p.parse_args(argv)
    if a.table:
        return table(a.table)
    if a.out is None:
        p.error("--out or --table is required")
    return run(a.out, a.budget_s, a.dry_run, a.only)


if __name__ == "__main__":
    sys.exit(main())
