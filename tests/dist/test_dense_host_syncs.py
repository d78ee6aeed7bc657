"""Host syncs of a dense training step on two gloo ranks, counted on the CPU as a CUDA run would wait
(tests/helpers/host_syncs.py, tests/dist/host_sync_driver.py). Issue 34: context parallel adds none to the step
(the layout is planned from the host's document ids: 12 more per step of 2 micro-batches before); off log steps a
step under FSDP needs at most one: the step's one read (trainer/readout.py: the loss, the norm, the agreed finite
flag and stop request, the metric's sums in one copy; 7 before: the clipped norm's read, the finite check's
pageable flag and its read, the loss's `.item()`, the metrics' `.cpu()`, and the stop request's pageable tensor
and `.tolist()`; not counted on the CPU: the timer's event syncs, FSDP's root input copy)."""

import json

import pytest

from tests.helpers.launch import run_train

pytestmark = pytest.mark.slow

STEPS = 4
COMMON = ["--config", "configs/tiny.py", "--set", f"data.total_steps={STEPS}", "data.valid_every=0",
          "monitor.log_every=100", "model_type=INTERNLM2", "model.num_kv_attention_heads=2"]


def _sites(tmp_path, name: str, extra: list[str]) -> list[dict]:
    prefix = str(tmp_path / name)
    p = run_train([prefix, *COMMON[:2], "--run-dir", str(tmp_path / f"{name}_run"), *COMMON[2:], *extra], nproc=2,
                  script="tests/dist/host_sync_driver.py")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.load(open(f"{prefix}.rank{r}.json")) for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("syncs")
    return {"fsdp": _sites(tmp, "fsdp", ["parallel.zero1=-1"]), "cp2": _sites(tmp, "cp2", ["parallel.context=2"])}


def test_context_parallel_adds_no_host_sync(runs):
    for fsdp, cp in zip(runs["fsdp"], runs["cp2"]):
        for step in ("2", "3", "4"):  # the first step also builds (kernel probes, caches)
            assert sorted(cp[step]) == sorted(fsdp[step]), (step, cp[step], fsdp[step])


def test_a_dense_fsdp_step_off_log_steps_syncs_at_most_once(runs):
    for rank in runs["fsdp"]:
        assert len(rank["3"]) <= 1, rank["3"]
