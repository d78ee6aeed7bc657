"""FSDP over expert-parallel weights, one rank of a 16-rank job (fake process group): every rank holds an equal part
of its experts, and initialization draws exactly that part, bitwise the unsharded model's values.

With as many expert-parallel ranks as experts per rank's share (4 experts on ep 4: one expert per rank), FSDP's
default dim 0 over the 4 remaining data-parallel ranks would leave each expert whole on one rank and nothing on
the other three; the experts are sharded on their next even dimension instead. With several local experts (16 on
ep 2: 8 per rank over 8 ranks), dim 0 stays (a strided shard), which initialization must read as DTensor lays it
out."""

import json
import subprocess
import sys

import pytest

from tests.helpers.launch import ROOT


@pytest.mark.parametrize("experts,ep,dim0", [(4, 4, False), (16, 2, True)])
def test_expert_shards_are_even_and_initialized_in_place(experts, ep, dim0):
    rank = 9  # coordinates (4, 1) of (data-parallel rest, ep) at ep 2; (2, 1) at ep 4
    p = subprocess.run([sys.executable, str(ROOT / "tests/unit/expert_shard_driver.py"), str(rank), str(experts),
                        str(ep)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["whole_draws"] == []  # no rank draws a whole parameter to keep a part of it
    for name, r in result["params"].items():
        assert r["same"], name
        full = {"w1": [experts, 384, 128], "w3": [experts, 384, 128], "w2": [experts, 128, 384]}[name[-2:]]
        # an equal part on every rank: the local elements are 1 / 16 of the parameter
        assert r["local"][0] * r["local"][1] * r["local"][2] * 16 == full[0] * full[1] * full[2], (name, r)
        assert r["placements"][1] == "Shard(dim=0)"  # the experts over ep
        assert r["placements"][0].startswith("_StridedShard(dim=0" if dim0 else "Shard(dim=1)"), (name, r)
