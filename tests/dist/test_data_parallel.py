"""Two processes (gloo): data parallel, replicated and sharded, trains as one process does.

The replicated run starts under torchrun, as users start it; the one-process reference and the sharded run fork
from the warm test interpreter with the environment torchrun gives (tests/helpers/warm.py).

The reference is one process running the same global batch (micro_num 4 instead of 2 ranks x 2): the loader
gives rank r the rows [consumed + 2r, consumed + 2r + 2), so the two runs see the same rows in the same order and
average the same gradients. Measured (10 steps of configs/tiny.py, replicated and FSDP alike): losses agree within
5e-7, gradient norms within 4e-6 (relative), each weight tensor ends within 2.2e-5 of how far it moved
(|w - w_ref| / |w - w0|), and every tensor moved by 1.5e-2 or more (max |w - w0|); the loss falls 6.26 -> 4.52.
"""

import pytest
import torch

from tests.helpers.launch import read_metrics, run_train

pytestmark = pytest.mark.slow

STEPS = 10
COMMON = ["--config", "configs/tiny.py", "--set", f"data.total_steps={STEPS}", "data.valid_every=0"]


def _train(tmp, name, nproc, extra, torchrun=False):
    run, prefix = tmp / name, str(tmp / f"{name}.weights")
    args = [prefix, *COMMON[:2], "--run-dir", str(run), *COMMON[2:], *extra]
    p = run_train(args, nproc=nproc, script="tests/dist/dp_driver.py", fresh=torchrun)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    weights = [(torch.load(f"{prefix}.rank{r}.init.pt"), torch.load(f"{prefix}.rank{r}.pt")) for r in range(nproc)]
    return read_metrics(run), weights


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same global batch in one process: micro_num 4."""
    recs, ((init, final),) = _train(tmp_path_factory.mktemp("ref"), "ref", 1, ["parallel.zero1=1", "data.micro_num=4"])
    return recs, init, final


def _assert_same_training(recs, ranks, one_process):
    ref_recs, ref_init, ref_final = one_process
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    # the trajectory is the one-process one, step by step (a wrong gradient average changes grad_norm at once)
    for r, q in zip(recs, ref_recs):
        assert r["loss"] == pytest.approx(q["loss"], abs=1e-5), (r["step"], r["loss"], q["loss"])
        assert r["grad_norm"] == pytest.approx(q["grad_norm"], rel=1e-4), (r["step"], r["grad_norm"], q["grad_norm"])
        # 2 ranks x 2 micro-batches of 512 tokens per step, counted on both sides
        assert r["num_consumed_tokens"] == q["num_consumed_tokens"] == r["step"] * 2 * 2 * 512
    assert recs[0]["loss"] > 6.0 and recs[-1]["loss"] < recs[0]["loss"] - 1.5  # 6.26 -> 4.52 measured
    (init0, final0), (init1, final1) = ranks
    assert init0.keys() == final0.keys() == ref_final.keys() and len(final0) == 29
    for name in final0:
        # both ranks start from the one-process init and end with identical weights
        assert torch.equal(init0[name], ref_init[name]) and torch.equal(init1[name], ref_init[name]), name
        assert torch.equal(final0[name], final1[name]), name
        moved = final0[name] - init0[name]
        assert moved.abs().max() > 5e-3, (name, moved.abs().max())  # Adam at lr 3e-3: every tensor moves
        # ... where the one-process run ends (float reduction order aside)
        gap = (final0[name] - ref_final[name]).norm() / moved.norm()
        assert gap < 1e-3, (name, gap)


def test_torchrun_two_ranks_replicated_equals_one_process(tmp_path, one_process):
    recs, ranks = _train(tmp_path, "dp", 2, ["parallel.zero1=1"], torchrun=True)
    _assert_same_training(recs, ranks, one_process)
    # replicated: the CPU allocator keeps freed memory for the next step (speed)
    assert "freed tensor memory is kept for reuse" in (tmp_path / "dp" / "rank0.log").read_text()


def test_two_ranks_fsdp_sharded_equals_one_process(tmp_path, one_process):
    recs, ranks = _train(tmp_path, "fsdp", 2, ["parallel.zero1=-1"])
    _assert_same_training(recs, ranks, one_process)
    # sharded: freed blocks of 1 MiB or more go back at once (a heap keeping them grows back to the unsharded size)
    assert "freed blocks of 1 MiB or more go back to the OS at once (sharded data parallel)" in \
        (tmp_path / "fsdp" / "rank0.log").read_text()
