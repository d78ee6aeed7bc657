"""train.py --simulate: one rank of a large job on this CPU (fake collectives), and the refusal when it cannot fit."""

import json

import pytest

from tests.helpers.launch import run_train

pytestmark = pytest.mark.slow


def test_rank0_of_16_holds_exactly_its_shards(tmp_path):
    run = tmp_path / "sim"
    p = run_train(["--config", "configs/tiny.py", "--simulate", "16", "--run-dir", str(run), "--set",
                   "data.total_steps=2", "parallel.tensor=2", "parallel.pipeline=2", "parallel.zero1=-1",
                   "data.micro_num=2", "data.seq_len=64", "model.dtype=torch.bfloat16", "data.valid_every=0"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((run / "simulate.json").read_text())
    # rank 0 of tensor 2 x pipeline 2 x data 4 runs stage 0 (embedding + block 0) of configs/tiny.py
    # (hidden 128, FFN 384, vocabulary 512, bias on q/k/v/o). Tensor-parallel weights are split by 2 and then
    # by FSDP over 4; the replicated ones (the two norms, o's bias) only by FSDP:
    tp_sharded = 512 * 128 + 3 * (128 * 128 + 128) + 128 * 128 + 3 * 384 * 128
    replicated = 128 + 128 + 128
    assert summary["parameters_held"] == tp_sharded // 8 + replicated // 4 == 34960
    assert summary["steps"] == 2 and summary["layout"].startswith("dp=4 (shard 4 x replicate 1) tp=2 pp=2")
    report = json.loads((run / "memory_report.json").read_text())
    assert summary["peak_bytes"] == report["peak"]["peak_bytes"] > 0
    assert len([line for line in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in line]) == 2
    assert "peak / estimate" in p.stdout


def test_a_share_that_cannot_fit_is_refused_in_one_line(tmp_path):
    p = run_train(["--config", "configs/70B.py", "--simulate", "2", "--run-dir", str(tmp_path / "x"),
                   "--set", "parallel.tensor=1", "parallel.sequence_parallel=False"])
    assert p.returncode != 0
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "--simulate 2: rank 0's share needs about" in err[0] and "GiB free" in err[0], p.stderr
