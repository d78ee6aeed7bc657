"""A lost replica group does not stop the job (parallel.fault_tolerance, torchft over gloo): a real lighthouse on
loopback, two replica groups of two ranks each (FSDP inside each group); group 1 is SIGKILLed in the middle of the
run; group 0 keeps stepping alone (every step number once in its metrics.jsonl, no restart); group 1 started again
heals from group 0 (no checkpoint anywhere) and both end with bit-identical weights and optimizer state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.ft import Lighthouse, start_group, train_records, wait_for, wait_group

pytest.importorskip("torchft", reason="parallel.fault_tolerance needs torchft (requirements-dev.txt)")
pytestmark = pytest.mark.slow

STEPS = 16
KILL_AT = 6


def group_args(run: Path, replica_id: int, lighthouse: str, die_at: int | str = 0, steps: int = STEPS,
               alone: float = 0.4) -> list[str]:
    """ft_driver.py: 0.05 s between steps with both groups in the quorum, `alone` s otherwise (time for group 1 to
    come back before the end), SIGKILLed after the backward of step `die_at` (0: never; "S@R": rank R only); then
    train.py's arguments."""
    return ["0.05", str(alone), str(die_at), "--", "--config", "configs/tiny.py", "--run-dir", str(run), "--set",
            f"data.total_steps={steps}", "data.seq_len=64", "data.micro_num=1", "data.valid_every=0",
            "monitor.tensorboard=False", "monitor.log_every=100", "parallel.fault_tolerance.enable=True",
            f"parallel.fault_tolerance.replica_id={replica_id}", "parallel.fault_tolerance.group_size=2",
            f"parallel.fault_tolerance.lighthouse={lighthouse}", "parallel.fault_tolerance.timeout=10",
            "parallel.fault_tolerance.quorum_timeout=30"]


def digest(run: Path, rank: int) -> dict:
    return json.loads((run / f"digest-rank{rank}.json").read_text())


def test_a_killed_group_leaves_the_other_training_and_heals_from_it_on_return(tmp_path):
    lighthouse = Lighthouse(tmp_path / "lighthouse.log")
    g0_run, g1_run, g1_again = tmp_path / "group0", tmp_path / "group1", tmp_path / "group1-again"
    try:
        # group 0 first (the others heal from it at their start), then group 1 joins it ...
        group0 = start_group(0, 2, group_args(g0_run, 0, lighthouse.url))
        wait_for(lambda: train_records(g0_run), 120, "group 0's first step", group0)
        # ... and its ranks are SIGKILLed in the middle of step KILL_AT, while group 0 waits for their gradients
        group1 = start_group(1, 2, group_args(g1_run, 1, lighthouse.url, die_at=KILL_AT))
        codes1, out1 = wait_group(group1, 120)
        assert all(c not in (0, None) for c in codes1), out1[-4000:]
        wait_for(lambda: any(r["ft/participants"] == 1 and r["step"] >= KILL_AT for r in train_records(g0_run)), 60,
                 "group 0 stepping alone after the kill", group0)
        group1 = start_group(1, 2, group_args(g1_again, 1, lighthouse.url))
        codes0, out0 = wait_group(group0, 120)
        codes1, out1 = wait_group(group1, 120)
    finally:
        lighthouse.stop()
    assert codes0 == [0, 0], out0[-6000:]
    assert codes1 == [0, 0], out1[-6000:]

    # group 0: every step once, in order, no restart; the step group 1 died in was trained again without it
    recs0 = train_records(g0_run)
    assert [r["step"] for r in recs0] == list(range(1, STEPS + 1))
    assert all(r["kind"] == "train" for r in map(json.loads, (g0_run / "metrics.jsonl").read_text().splitlines()))
    assert {r["ft/participants"] for r in recs0[:KILL_AT - 1]} == {1, 2}  # alone at first, then with group 1
    assert recs0[KILL_AT - 1]["ft/participants"] == 1 and recs0[-1]["ft/participants"] == 2
    assert all(r["ft/heals"] == 0 for r in recs0)  # the live group never took anyone's state
    for rank in (0, 1):
        log = (g0_run / f"rank{rank}.log").read_text()
        assert f"replica group 0: step {KILL_AT} not committed" in log and "training it again" in log
    # group 1 before the kill: healed from group 0 at its start, stepped with it, never reached step KILL_AT
    recs1 = train_records(g1_run)
    assert recs1 and recs1[0]["ft/heals"] == 1 and recs1[-1]["step"] == KILL_AT - 1

    # group 1 again: healed from group 0 (no checkpoint was saved anywhere), then stepped on from there
    recs1 = train_records(g1_again)
    first = recs1[0]["step"]
    assert first > KILL_AT and [r["step"] for r in recs1] == list(range(first, STEPS + 1))
    assert recs1[0]["ft/heals"] == 1 and not list(tmp_path.rglob("COMPLETE"))
    # ... and says so: the step it healed to, in its log and as a `heal` record before its first train record
    heal = [json.loads(line) for line in (g1_again / "metrics.jsonl").read_text().splitlines()][0]
    assert heal == {"kind": "heal", "step": first - 1, "replica_id": 1, "from_step": 0, "to_step": first - 1,
                    "heals": 1}
    for rank in (0, 1):
        assert (f"replica group 1: healed from a live peer at its step 0: continues from step {first - 1}; steps "
                f"1-{first - 1} were trained by the live groups, not by this one") in (g1_again / f"rank{rank}.log"
                                                                                       ).read_text()

    # the same weights and optimizer state, bit for bit, on each rank of both groups
    for rank in (0, 1):
        a, b = digest(g0_run, rank), digest(g1_again, rank)
        assert a["step"] == b["step"] == STEPS
        assert (a["model"], a["optimizer"]) == (b["model"], b["optimizer"])
    assert digest(g0_run, 0)["model"] != digest(g0_run, 1)["model"]  # two shards: the digests see real bytes


def test_groups_of_one_process_meet_through_a_store_they_host(tmp_path):
    """A group of one process forms no process group, so there is no launcher's store for torchft's manager; it
    hosts one (before, the manager waited for MASTER_ADDR:MASTER_PORT forever)."""
    lighthouse = Lighthouse(tmp_path / "lighthouse.log")
    runs = [tmp_path / "group0", tmp_path / "group1"]
    try:
        groups = [start_group(g, 1, group_args(runs[g], g, lighthouse.url)) for g in (0, 1)]
        results = [wait_group(ranks, 120) for ranks in groups]
    finally:
        lighthouse.stop()
    for codes, out in results:
        assert codes == [0], out[-6000:]
    assert train_records(runs[0])[-1]["ft/participants"] == 2
    assert digest(runs[0], 0) == dict(digest(runs[1], 0), heals=digest(runs[0], 0)["heals"])


def test_a_group_with_one_dead_rank_leaves_at_once_and_the_other_trains_on(tmp_path):
    """Rank 1 of group 1 dies inside a step; its rank 0, waiting for the group's vote, is stopped by its agent
    (SIGTERM) and leaves at once instead of heartbeating on (torchft forms no quorum without more than half of the
    heartbeating groups: group 0 would wait for it until its quorum_timeout and die); group 0 trains that step again
    alone and finishes."""
    lighthouse = Lighthouse(tmp_path / "lighthouse.log")
    g0_run, g1_run = tmp_path / "group0", tmp_path / "group1"
    try:
        group0 = start_group(0, 2, group_args(g0_run, 0, lighthouse.url, steps=10, alone=0.05))
        wait_for(lambda: train_records(g0_run), 120, "group 0's first step", group0)
        group1 = start_group(1, 2, group_args(g1_run, 1, lighthouse.url, die_at="5@1", steps=10, alone=0.05))
        codes1, out1 = wait_group(group1, 120)
        codes0, out0 = wait_group(group0, 120)
    finally:
        lighthouse.stop()
    assert codes1[1] == -9 and codes1[0] not in (0, None), out1[-4000:]
    assert "replica group 1: SIGTERM (its agent stops it) while waiting for its" in (g1_run / "rank0.log").read_text()
    assert codes0 == [0, 0], out0[-6000:]
    recs0 = train_records(g0_run)
    assert [r["step"] for r in recs0] == list(range(1, 11)) and recs0[4]["ft/participants"] == 1
    assert max(r["ft/quorum_time"] for r in recs0) < 10  # never near the 30 s quorum_timeout
