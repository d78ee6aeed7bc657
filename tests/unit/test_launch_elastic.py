"""A restarted group meets in the store its dead predecessor used (torchrun's agent store outlives the workers): every
group agrees on a fresh generation, whatever the order its ranks arrive in and whatever the dead group left."""

import threading
import time

import pytest
import torch.distributed as dist

from internlm_core.distributed.launch import JOIN_PREFIX, join_generation, restart_count
from internlm_core.errors import LaunchError


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield server


def group(port: int, world: int, delays: list[float], timeout: float = 10) -> dict[int, str]:
    """Each rank joins from its own client after its delay; {rank: generation}."""
    out: dict[int, str] = {}

    def run(r: int) -> None:
        time.sleep(delays[r])
        out[r] = join_generation(dist.TCPStore("127.0.0.1", port, is_master=False), r, world, timeout)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_every_group_agrees_on_a_fresh_generation(store):
    seen = set()
    # rank 0 first, last, in the middle: the ranks of one group always agree, and no group reuses an id
    for delays in ([0, 0.1, 0.2], [0.3, 0, 0.1], [0.1, 0.3, 0]):
        gens = group(store.port, 3, delays)
        assert len(set(gens.values())) == 1, gens
        seen.add(gens[0])
    assert len(seen) == 3


def test_stale_keys_of_a_dead_group_are_not_taken_for_the_new_ones(store):
    # a dead group's ranks said hello and a dead rank 0 welcomed them: nobody of the new group may use that
    store.set(f"{JOIN_PREFIX}/hello/1", "oldnonce")
    store.set(f"{JOIN_PREFIX}/welcome/oldnonce", "deadgeneration")
    store.set(f"{JOIN_PREFIX}/ready/deadgeneration/1", "1")
    gens = group(store.port, 2, [0.2, 0])  # the new rank 1 arrives first, while the stale keys are there
    assert gens[0] == gens[1] != "deadgeneration"


def test_missing_rank_is_named(store):
    one = threading.Thread(target=lambda: join_generation(dist.TCPStore("127.0.0.1", store.port), 1, 3, 5))
    one.start()
    with pytest.raises(LaunchError, match=r"rank 0: rank\(s\) 2 of 3 did not join within 1 s"):
        join_generation(store, 0, 3, timeout_s=1)  # rank 2 never comes
    one.join()
    with pytest.raises(LaunchError, match="rank 1: rank 0 did not answer within 1 s while forming the process group of 2"):
        join_generation(dist.TCPStore("127.0.0.1", store.port), 1, 2, timeout_s=1)


def test_restart_count_adds_torchrun_restarts_and_slurm_requeues():
    assert restart_count({}) == 0
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "1", "SLURM_RESTART_COUNT": "3"}) == 4
    with pytest.raises(LaunchError, match="SLURM_RESTART_COUNT='x' is not an integer"):
        restart_count({"SLURM_RESTART_COUNT": "x"})
