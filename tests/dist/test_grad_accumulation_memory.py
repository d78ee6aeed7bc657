"""Gradient accumulation under FSDP, measured: two CPU ranks (zero1 over both) train 4 micro-batches per step once
reduce-scattering every micro-batch (the trainer's choice) and once reducing at the last micro-batch only (what
`set_requires_gradient_sync(False)` did). The second keeps every gradient unsharded in fp32 in between: its peak
is higher by the estimator's `accumulated_gradients` term, and the memory report files it under that name, not
under activations."""

from __future__ import annotations

import json

import pytest

from internlm_core.config import load_config
from internlm_core.estimate import estimate
from tests.helpers.launch import run_train

pytestmark = pytest.mark.slow


# ~25M parameters, nearly all in the 8 blocks (FSDP's units, as in a 7B model; the root's embedding and output
# are reduced at the end of backward in either mode): 4 * 25M / 2 = 51 MB beyond each rank's shard
SETS = ["data.total_steps=2", "data.valid_every=0", "monitor.memory_report=True", "monitor.tensorboard=False",
        "model.hidden_size=512", "model.num_layers=8", "model.vocab_size=512", "data.seq_len=64",
        "data.micro_bsz=1", "data.micro_num=4", "parallel.zero1=-1", "model.dtype=torch.float32"]
# the peak RSS tracks live tensors: tests/helpers/train_live_memory.py sets glibc so
DRIVER = "tests/helpers/train_live_memory.py"


def peak_of(tmp_path, mode: str) -> dict:
    run = tmp_path / mode
    p = run_train(["--grad-reduce", mode, "--config", "configs/tiny.py", "--run-dir", str(run), "--set", *SETS],
                  nproc=2, script=DRIVER, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    log = (run / "rank0.log").read_text()
    assert f"gradients reduced every {mode.replace('_', '-')}" in log
    return json.loads((run / "memory_report.json").read_text())["peak"]


def test_accumulated_unsharded_gradients_measured_against_the_estimate(tmp_path):
    every = peak_of(tmp_path, "micro_batch")
    once = peak_of(tmp_path, "step")
    term = estimate(load_config("configs/tiny.py", SETS), 2, device="cpu", grad_reduce="step")
    predicted = term.memory.accumulated_gradients
    assert predicted > 45 * 2**20
    assert estimate(load_config("configs/tiny.py", SETS), 2, device="cpu").memory.accumulated_gradients == 0
    measured = (once["peak_bytes"] - once["overhead"]) - (every["peak_bytes"] - every["overhead"])
    assert abs(measured / predicted - 1) < 0.25, (measured / 2**20, predicted / 2**20)
    # the report names them: the same bytes the estimate predicts, and no longer inside "activations"
    assert every["accumulated_gradients"] == 0
    assert abs(once["accumulated_gradients"] / predicted - 1) < 0.01
    assert abs(once["activations_estimate"] - every["activations_estimate"]) < 0.25 * predicted
