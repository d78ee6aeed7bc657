"""The vocabulary-parallel embedding on two gloo ranks: the unsharded embedding's output and gradient, each rank
computing only its own rows' gradient (DTensor's RowwiseParallel computed the whole vocabulary's on every rank)."""

import pytest

from tests.helpers.launch import ROOT, env

pytestmark = pytest.mark.slow


def test_vocab_parallel_embedding_matches_and_keeps_its_rows():
    from tests.helpers import warm
    p = warm.run(str(ROOT / "tests/dist/vocab_embedding_driver.py"), [], env(), ROOT, timeout=120, nproc=2)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert p.stdout.count(": ok") == 2, p.stdout
