"""model.fp8 under FSDP2, pipeline and tensor parallel (two gloo processes, CPU): the float8 linears train as one
process does on the same global batch; the float8 all-gather travels over gloo as bytes, bitwise FSDP's own gather.
Measured (4 steps): the pipeline run's losses equal the one-process ones bitwise, its gradient norms within 1e-7
relative.

Without the float8 all-gather FSDP gathers the fp32 weights whole before each Float8Linear runs, so the tensorwise
weight scale is the whole weight's as in one process; rank r's micro-batch k holds the rows the one-process run's
micro-batch 2r + k holds (tests/dist/test_data_parallel.py), so the activation scales agree too."""

import pytest

from tests.helpers.launch import read_metrics, run_train

pytestmark = pytest.mark.slow

STEPS = 4
COMMON = ["model.fp8=tensorwise", "model.dtype=torch.float32", "data.seq_len=64", "data.valid_every=0",
          f"data.total_steps={STEPS}", "monitor.log_every=100", "monitor.tensorboard=False"]


def _run(tmp_path, name, nproc, extra):
    run = tmp_path / name
    p = run_train(["--config", "configs/tiny.py", "--run-dir", str(run), "--set", *COMMON, *extra], nproc=nproc)
    return p, run


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same global batch in one process: micro_num 4."""
    p, run = _run(tmp_path_factory.mktemp("ref"), "one", 1, ["parallel.zero1=1", "data.micro_num=4"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "model.fp8: recipe tensorwise, 14 linear layers in float8" in p.stdout + p.stderr
    return read_metrics(run)


@pytest.mark.parametrize("layout,rel", [
    # FSDP2: 1e-3 passed at fcb6e36; later commits (the global token mean, a862ba2, among them) move the step-4
    # gradient norm by 1.1e-3 (float8 rounding amplifies any change of summation order)
    (["parallel.zero1=-1", "data.micro_num=2"], (1e-4, 3e-3)),
    (["parallel.zero1=1", "parallel.pipeline=2", "data.micro_num=4"], (1e-4, 1e-3))],
    # tensor parallel 2 through train.py (float8 styles): losses within 8e-5, gradient norms within 2e-3 of one
    # process (measured once; left out of the suite for time: fp8_gather_driver.py checks the styles' numbers)
    ids=["fsdp2", "pipeline2"])
def test_float8_trains_as_one_process(tmp_path, one_process, layout, rel):
    p, run = _run(tmp_path, "two", 2, layout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    got = read_metrics(run)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for r, q in zip(got, one_process):
        assert r["loss"] == pytest.approx(q["loss"], rel=rel[0]), (r["step"], r["loss"], q["loss"])
        assert r["grad_norm"] == pytest.approx(q["grad_norm"], rel=rel[1]), (r["step"], r["grad_norm"], q["grad_norm"])
    assert got[-1]["loss"] < got[0]["loss"]


def test_tensor_parallel_styles_and_float8_all_gather_on_gloo():
    """tests/dist/fp8_gather_driver.py, one launch: tensor parallel 2 with torchao's float8 styles against one
    process; FSDP2 units of float8 weights only, whose float8 buffer plain gloo refuses and send_float8_as_bytes
    gathers as uint8, bitwise FSDP's fp32 all-gather's outputs and gradients."""
    from tests.helpers import warm
    from tests.helpers.launch import ROOT, env

    p = warm.run(str(ROOT / "tests/dist/fp8_gather_driver.py"), [], env(), ROOT, timeout=180, nproc=2)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert p.stdout.count("plain gloo refused: Invalid scalar type") == 2, p.stdout
    assert p.stdout.count("bytes ok") == 2 and p.stdout.count("tensor parallel sp=False ok") == 2, p.stdout
