"""A restarted run keeps one metrics.jsonl: a `restart` record (or a spike's `rewind` record) at step S voids the
earlier records of steps after S, so the last record of each step is the one that counts, and the plots draw that."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from internlm_core.monitor.restart import RestartReporter, last_train_record
from internlm_core.utils.writer import MetricsWriter

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import plot_metrics  # noqa: E402


class Alerts:
    def __init__(self):
        self.sent = []

    def send(self, subject, content, level="error"):
        self.sent.append((subject, content, level))


class Trainer:
    """What the reporter sees (a StepView's step and resumed_from) and the run's writer it is given."""

    def __init__(self, run_dir: Path, step: int):
        self.step, self.resumed_from = step, "/ckpt/30"
        self.writer = MetricsWriter(run_dir, active=True)


def train(step: int, loss: float) -> dict:
    return {"kind": "train", "step": step, "loss": loss}


def test_restart_record_then_retrained_steps_and_the_time_lost(tmp_path):
    first = [train(s, 10.0 - s / 10) for s in range(1, 36)]
    text = "".join(json.dumps(r) + "\n" for r in first) + '{"kind": "train", "step": 36, "lo'  # cut by the kill
    (tmp_path / "metrics.jsonl").write_text(text)
    assert last_train_record(tmp_path / "metrics.jsonl")[0] == 35
    alerts = Alerts()
    trainer = Trainer(tmp_path, 30)
    rep = RestartReporter(tmp_path, rank=0, restart_count=1, max_restarts=2, alerts=alerts, writer=trainer.writer)
    rep.on_train_start(trainer)
    for s in range(31, 37):
        trainer.writer.write(s, {"loss": 1.0})
        rep.on_step_end(trainer, {"step": s})
    trainer.writer.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    restart = json.loads(lines[36])  # after the 35 records and the cut line, on a line of its own
    assert restart["kind"] == "restart" and restart["step"] == 30 and restart["restart"] == 1
    assert restart["last_step"] == 35 and restart["steps_to_retrain"] == 5 and restart["checkpoint"] == "/ckpt/30"
    assert restart["max_restarts"] == 2 and restart["down_s"] >= 0
    assert len(alerts.sent) == 2 and alerts.sent[0][0] == "run restarted at step 30 (restart 1)"
    assert alerts.sent[0][1] == ("restart 1 of at most 2: the run stopped after step 35 "
                                 f"{restart['down_s']:.0f} s ago; resumed from step 30 (/ckpt/30); steps 31-35 are "
                                 "trained again")
    assert alerts.sent[1][0].startswith("run recovered at step 35: ") and alerts.sent[1][0].endswith(" s lost")

    run = plot_metrics.read_run(tmp_path)
    assert [r["step"] for r in run.train] == list(range(1, 37))
    assert [r["loss"] for r in run.train][29:] == [7.0] + [1.0] * 6  # steps 31-36 from after the restart
    assert run.skipped_lines == 1 and [e["kind"] for e in run.events] == ["restart"]


def test_rewind_voids_the_spiking_steps_even_when_they_are_skipped(tmp_path):
    recs = [train(s, 2.0) for s in range(1, 36)]
    recs[32:35] = [train(s, 9.0) for s in (33, 34, 35)]
    recs.append({"kind": "rewind", "step": 30, "skip_batches": [32, 33, 34]})
    recs += [train(s, 2.5) for s in (31, 32, 36, 37)]  # 33-35 skipped: no record after the rewind
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = plot_metrics.read_run(tmp_path)
    assert [r["step"] for r in run.train] == list(range(1, 33)) + [36, 37]
    assert max(run.series("loss")[1]) == 2.5 and run.events[0]["step"] == 30


def test_fresh_run_writes_no_restart_record(tmp_path):
    trainer = Trainer(tmp_path, 0)
    rep = RestartReporter(tmp_path, rank=0, restart_count=0, alerts=Alerts(), writer=trainer.writer)
    rep.on_train_start(trainer)
    trainer.writer.close()
    assert (tmp_path / "metrics.jsonl").read_text() == "" and rep.alerts.sent == []


def test_a_replica_group_says_its_retrain_waits_for_the_heal_and_the_heal_is_an_event(tmp_path):
    """A replica group that restarts resumes its own checkpoint, then heals past it when a live group is ahead:
    its restart line does not promise the retrain; the heal record (trainer/replicated.record_heal) names the step."""
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(train(s, 2.0)) + "\n" for s in range(1, 36)))
    alerts = Alerts()
    trainer = Trainer(tmp_path, 30)
    rep = RestartReporter(tmp_path, rank=0, restart_count=1, alerts=alerts, writer=trainer.writer, replica_group=1)
    rep.on_train_start(trainer)
    trainer.writer.write(60, {"replica_id": 1, "from_step": 30, "to_step": 60, "heals": 1}, kind="heal")
    trainer.writer.write(61, {"loss": 1.0})
    trainer.writer.close()
    restart = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][35]
    assert restart["kind"] == "restart" and restart["replica_group"] == 1 and restart["steps_to_retrain"] == 5
    assert alerts.sent[0][1].endswith("resumed from step 30 (/ckpt/30); replica group 1: steps 31-35 are trained "
                                      "again unless a live group is ahead (then it heals from it at its first "
                                      "quorum and logs the step it continues from)")
    run = plot_metrics.read_run(tmp_path)
    assert [e["kind"] for e in run.events] == ["restart", "heal"] and run.events[1]["step"] == 60
    assert [r["step"] for r in run.train] == list(range(1, 31)) + [61]
