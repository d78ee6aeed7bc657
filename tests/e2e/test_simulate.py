"""train.py --simulate: one rank of a large job on this CPU (fake collectives), and the refusal when it cannot fit."""

import json

import pytest

from tests.helpers.launch import run_script, run_train

pytestmark = pytest.mark.slow


# a mid-size layout: configs/tiny.py widened to 116M parameters (hidden 1024, FFN 2752, 4 layers, vocabulary
# 32,000), bf16, rank 0 of tensor 2 x pipeline 2 x data 2: stage 0 (embedding + blocks 0-1)
MID = ["data.total_steps=2", "parallel.tensor=2", "parallel.pipeline=2", "parallel.zero1=-1", "data.micro_num=4",
       "data.micro_bsz=1", "data.seq_len=64", "model.dtype=torch.bfloat16", "model.hidden_size=1024",
       "model.num_layers=4", "model.num_attention_heads=16", "model.vocab_size=32000", "data.valid_every=0"]


def test_rank0_of_8_holds_its_shards_and_peaks_where_the_estimator_says(tmp_path):
    run = tmp_path / "sim"
    p = run_train(["--config", "configs/tiny.py", "--simulate", "8", "--run-dir", str(run), "--set", *MID])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((run / "simulate.json").read_text())
    # tensor-parallel weights (the vocabulary-parallel embedding; q, k, v with bias, o, w1, w2, w3) are split by 2
    # and then by FSDP over 2; the replicated ones (the two norms, o's bias) only by FSDP
    H, F, V, blocks = 1024, 2752, 32000, 2
    tp_sharded = V * H + blocks * (3 * (H * H + H) + H * H + 3 * F * H)
    replicated = blocks * 3 * H
    assert summary["parameters_held"] == tp_sharded // 4 + replicated // 2 == 14_520_832
    assert summary["steps"] == 2 and summary["layout"].startswith("dp=2 (shard 2 x replicate 1) tp=2 pp=2")
    report = json.loads((run / "memory_report.json").read_text())
    peak = report["peak"]["peak_bytes"]
    assert summary["peak_bytes"] == peak > 0
    assert len([line for line in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in line]) == 2
    assert "peak / estimate" in p.stdout
    # the estimator's CPU prediction for this rank's stage, in the run and from tools/estimate.py: within 20%
    assert 0.8 <= summary["peak_over_estimate"] <= 1.2, summary
    tool = run_script("tools/estimate.py", ["--config", "configs/tiny.py", "--gpus", "8", "--device", "cpu",
                                            "--pipeline-rank", "0", "--json", "--set", *MID])
    assert tool.returncode == 0, tool.stderr
    total = json.loads(tool.stdout)["memory_gib"]["total"] * 2**30
    assert abs(peak / total - 1) <= 0.2, (peak / 2**30, total / 2**30)
    # what the model adds (beyond the process itself) is most of the peak: the check is about the model's terms
    assert peak - report["peak"]["overhead"] > 0.5 * peak


def test_a_share_that_cannot_fit_is_refused_in_one_line(tmp_path):
    p = run_train(["--config", "configs/70B.py", "--simulate", "2", "--run-dir", str(tmp_path / "x"),
                   "--set", "parallel.tensor=1", "parallel.sequence_parallel=False"])
    assert p.returncode != 0
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "--simulate 2: rank 0's share needs about" in err[0] and "GiB free" in err[0], p.stderr
