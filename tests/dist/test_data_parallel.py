"""Two processes under torchrun (gloo): plain data parallel trains with falling loss and identical replicas."""

import pytest
import torch

from tests.helpers.launch import read_metrics, run_train

pytestmark = pytest.mark.slow


def test_torchrun_two_ranks_identical_weights(tmp_path):
    run = tmp_path / "run"
    prefix = str(tmp_path / "weights")
    p = run_train([prefix, "--config", "configs/tiny.py", "--run-dir", str(run), "--set", "data.total_steps=20",
                   "parallel.zero1=1", "data.valid_every=0"], nproc=2, script="tests/dist/dp_driver.py")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = read_metrics(run)
    assert len(recs) == 20
    assert sum(r["loss"] for r in recs[-3:]) / 3 < recs[0]["loss"] - 0.5
    assert recs[-1]["num_consumed_tokens"] == 20 * 2 * 2 * 512  # both ranks' tokens are counted
    w0 = torch.load(f"{prefix}.rank0.pt")
    w1 = torch.load(f"{prefix}.rank1.pt")
    assert w0.keys() == w1.keys() and len(w0) > 0
    for name in w0:
        assert torch.equal(w0[name], w1[name]), name
    # the replicas did train: weights moved away from a fresh init
    assert not torch.equal(w0["layers.0.attention.wq.weight"], torch.zeros_like(w0["layers.0.attention.wq.weight"]))


def test_torchrun_two_ranks_fsdp_sharded(tmp_path):
    run = tmp_path / "run"
    p = run_train(["--config", "configs/tiny.py", "--run-dir", str(run), "--set", "data.total_steps=10",
                   "parallel.zero1=-1", "data.valid_every=0"], nproc=2)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert len(read_metrics(run)) == 10
