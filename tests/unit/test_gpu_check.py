"""tools/gpu_check.sh's table from what its parts leave behind (the GPU parts themselves need a GPU)."""

import json
import subprocess

from tests.helpers.launch import ROOT, run_script


def test_one_table_from_the_kernel_rows_and_the_training_runs(tmp_path):
    (tmp_path / "paths.json").write_text(json.dumps([
        {"check": "attention flash vs sdpa (packed)", "ok": True, "result": "max diff 7.8e-03", "detail": ""},
        {"check": "loss fused_chunked float16", "ok": True, "result": "0 entries lost", "detail": ""}]))
    run = tmp_path / "train1"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(
        {"kind": "train", "step": s, "loss": 10.0 - s / 10, "tgs": 1000.0 * s if s < 6 else 30000.0 + s,
         "mfu": 0.41 + s / 1000}) for s in range(1, 31)) + "\n")
    (run / "memory_report.json").write_text(json.dumps({"peak": {"peak_bytes": 40 * 2**30}}))
    p = run_script("bench/gpu_paths.py", ["--table", str(tmp_path)], timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert lines[0] == "| check | ok | result | detail |"
    assert "| loss fused_chunked float16 | ok | 0 entries lost |  |" in lines
    # median of steps 6..30 (30,018 tokens/s, MFU 42.8%)
    assert ("| train bench_gpu 1.1B bf16, 1 GPU | ok | 30,018 tokens/s/GPU, MFU 42.8% | 30 steps, final loss 7.000, "
            "peak 40.0 GiB |") in lines
    assert "| train FSDP, 2 GPUs | -- | not run |  |" in lines
    (tmp_path / "paths.json").write_text(json.dumps([{"check": "x", "ok": False, "result": "boom", "detail": ""}]))
    p = run_script("bench/gpu_paths.py", ["--table", str(tmp_path)], timeout=120)
    assert p.returncode == 1 and "| x | FAIL | boom |  |" in p.stdout


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(ROOT / "tools/gpu_check.sh")]).returncode == 0
