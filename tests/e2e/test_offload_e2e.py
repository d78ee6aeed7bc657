"""model.offload_activations through train.py (issue 38 item 4): 3 steps of the tiny config give the losses and
gradient norms of the run without it, bitwise (fp32), in one process, under FSDP over 2 ranks (its gathered
weights are parameters: kept) and under 2 pipeline stages (the stages' backward unpacks what each stage's blocks
offloaded)."""

import pytest

from tests.helpers.launch import read_metrics, run_train

pytestmark = pytest.mark.slow


def _run(tmp_path, offload, *extra, nproc=1):
    run = tmp_path / f"run_{offload}_{nproc}"
    p = run_train(["--config", "configs/tiny.py", "--run-dir", str(run), "--set", "data.total_steps=3",
                   "data.valid_every=0", f"model.offload_activations={offload}", *extra], nproc=nproc, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    if offload:
        assert "activation offload to host memory on" in p.stdout + p.stderr + (run / "rank0.log").read_text()
    return [(r["loss"], r["grad_norm"]) for r in read_metrics(run)]


@pytest.mark.parametrize("checkpoint", [False, True])
def test_offload_equals_no_offload(tmp_path, checkpoint):
    extra = (f"model.checkpoint={checkpoint}",)
    assert _run(tmp_path, True, *extra) == _run(tmp_path, False, *extra)


def test_offload_under_two_pipeline_stages(tmp_path):
    extra = ("parallel.pipeline=2", "model.num_layers=4")
    assert _run(tmp_path, True, *extra, nproc=2) == _run(tmp_path, False, *extra, nproc=2)


def test_offload_under_fsdp_two_ranks(tmp_path):
    assert _run(tmp_path, True, nproc=2) == _run(tmp_path, False, nproc=2)
