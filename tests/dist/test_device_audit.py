"""The device audit on two gloo ranks: a two-stage pipeline's per-step collectives, as if on CUDA, give the same
values on both stages (the first stage has no outputs: the case whose host-made metric sums crashed NCCL)."""

import json

import pytest

from tests.helpers.launch import ROOT, env
from tests.helpers.stage_collectives import expected_two_stages

pytestmark = pytest.mark.slow


def test_two_stage_collectives_run_on_the_groups_device():
    from tests.helpers import warm
    p = warm.run(str(ROOT / "tests/dist/stage_audit_driver.py"), [], env(), ROOT, timeout=120, nproc=2)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rows = sorted((json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")), key=lambda r: r["rank"])
    assert [r["pp_rank"] for r in rows] == [0, 1]
    want = expected_two_stages(dp=1)
    for r in rows:
        got = {k: r[k] for k in want}
        assert got == pytest.approx(want), r
