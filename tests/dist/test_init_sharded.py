"""Sharded initialization on two gloo ranks: DTensor shards (Shard(0), Shard(1); even and uneven splits, 2-D and 3-D)
hold bitwise the values of the unsharded init, each rank having drawn its own elements only (no tensor as large as
the whole parameter on any rank)."""

import pytest

from tests.helpers.launch import ROOT, env

pytestmark = pytest.mark.slow


def test_sharded_init_equals_the_unsharded_one_bitwise():
    from tests.helpers import warm
    p = warm.run(str(ROOT / "tests/dist/init_sharded_driver.py"), [], env(), ROOT, timeout=120, nproc=2)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert p.stdout.count(": ok") == 2, p.stdout
