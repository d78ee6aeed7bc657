"""The loop owns its decisions (issue 35 item 1): callbacks get a frozen, read-only StepView and decide nothing; the
loop's order for a step is judge health, observers, poll stop requests, rewind, save, validate, evaluate, stop;
a retry the replica groups did not commit trains the same batch again; an observer asks for a save only through
`view.requests`, honoured at the same step."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from internlm_core.callbacks import Progress, StepView, TrainerCallback
from internlm_core.config import load_config
from internlm_core.distributed import LaunchInfo
from internlm_core.trainer.build import build_trainer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
from fault_driver import inject_garbage  # noqa: E402

LAUNCH = LaunchInfo("none", 0, 1, 0, torch.device("cpu"), None)


def make(tmp_path: Path, name: str, steps: int, *sets: str, callbacks=None):
    cfg = load_config(ROOT / "configs/tiny.py", [
        f"data.total_steps={steps}", "data.micro_num=1", "data.valid_every=0", "monitor.tensorboard=False",
        "monitor.log_every=1000", "data.empty_cache_and_diag_interval=0", *sets])
    (tmp_path / name / "run").mkdir(parents=True)
    return build_trainer(cfg, LAUNCH, tmp_path / name / "run", extra_callbacks=callbacks)


def records(tmp_path: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / name / "run/metrics.jsonl").read_text().splitlines()]


class Order(TrainerCallback):
    """Logs (what, step) of the loop's named parts (wrapped by `spy`) and of the observer events, in call order."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def on_step_end(self, view, metrics):
        self.calls.append(("on_step_end", view.step))

    def on_save(self, view, step, path):
        self.calls.append(("on_save", step))

    def on_train_end(self, view):
        self.calls.append(("on_train_end", view.step))

    def spy(self, trainer, part: str, method: str, label: str) -> None:
        obj = getattr(trainer, part)
        real = getattr(obj, method)

        def called(*args, **kwargs):
            self.calls.append((label, trainer.state.batch_count))
            return real(*args, **kwargs)

        setattr(obj, method, called)

    def at(self, step: int) -> list[str]:
        return [what for what, s in self.calls if s == step]


def test_a_callback_cannot_change_the_view_it_gets(tmp_path):
    seen: list = []

    class Meddle(TrainerCallback):
        def on_step_end(self, view, metrics):
            with pytest.raises(dataclasses.FrozenInstanceError):
                view.step = 0
            with pytest.raises(dataclasses.FrozenInstanceError):
                view.progress.batch_count = 0
            with pytest.raises(TypeError):
                view.metrics["loss"] = 0.0  # a read-only mapping
            with pytest.raises(TypeError):
                metrics["loss"] = 0.0
            seen.append((view.step, view.state, dict(metrics)))

    trainer = make(tmp_path, "view", 2, callbacks=[Meddle()])
    trainer.train()
    assert [s for s, _, _ in seen] == [1, 2]
    # a snapshot, not the trainer's TrainState: step 1's view still says step 1
    assert isinstance(seen[0][1], Progress) and seen[0][1].batch_count == 1 and trainer.state.batch_count == 2
    assert [r["loss"] for r in records(tmp_path, "view") if r["kind"] == "train"] == [m["loss"] for _, _, m in seen]
    assert not any(isinstance(getattr(trainer, f.name), StepView) for f in dataclasses.fields(trainer))


def test_stop_file_and_an_observers_save_request_are_taken_at_their_step(tmp_path):
    order = Order()

    class AskSave(TrainerCallback):  # a driver's callback that wants a checkpoint of step 1 (no periodic save)
        def on_step_end(self, view, metrics):
            if view.step == 1:
                view.requests.ask_save("the driver wants step 1")

    stop_file = tmp_path / "stop" / "stop_file"
    trainer = make(tmp_path, "stop", 6, "ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder={tmp_path / 'ckpt'}",
                   "ckpt.checkpoint_every=4", f"ckpt.stop_file_path={stop_file}", callbacks=[AskSave(), order])
    for part, method, label in (("health", "judge", "judge"), ("stopper", "poll", "poll"),
                                ("checkpointer", "due", "save?"), ("checkpointer", "save", "save"),
                                ("checkpointer", "final", "final")):
        order.spy(trainer, part, method, label)
    stop_file.write_text("3")  # save at step 3 and stop
    state = trainer.train()

    assert state.batch_count == 3
    assert order.at(1) == ["judge", "on_step_end", "poll", "save?", "save", "on_save"]
    assert order.at(2) == ["judge", "on_step_end", "poll", "save?"]
    assert order.at(3) == ["judge", "on_step_end", "poll", "save?", "save", "on_save", "final", "on_train_end"]
    assert sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == [1, 3]
    meta = json.loads((tmp_path / "ckpt/1/meta.json").read_text())
    assert meta["reason"] == "the driver wants step 1"
    assert [r["step"] for r in records(tmp_path, "stop") if r["kind"] == "train"] == [1, 2, 3]


def test_spike_stop_file_and_rewind_at_one_step_rewind_first_and_save_nothing_of_the_spike(tmp_path):
    """Batches 9 and 10 are garbage: steps 10 and 11 spike; the stop file asks to save and stop at step 11, the step
    the rewind is due. The loop rewinds to step 8 (nothing of the spike is saved), then stops; step 8 is saved."""
    order = Order()
    stop_file = tmp_path / "stop" / "stop_file"
    trainer = make(tmp_path, "spike", 14, "ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder={tmp_path / 'ckpt'}",
                   "ckpt.checkpoint_every=4", f"ckpt.stop_file_path={stop_file}", "monitor.loss_spike_ratio=1.15",
                   "monitor.spike_rewind=True", "monitor.spike_rewind_steps=2", callbacks=[order])
    inject_garbage(trainer, 9, 2)
    trainer.health.warmup_steps = 5
    for part, method, label in (("health", "judge", "judge"), ("stopper", "poll", "poll"),
                                ("rewinder", "due", "rewind?"), ("rewinder", "rewind", "rewind"),
                                ("checkpointer", "due", "save?"), ("checkpointer", "save", "save"),
                                ("checkpointer", "final", "final")):
        order.spy(trainer, part, method, label)
    stop_file.write_text("11")
    state = trainer.train()

    assert order.at(8) == ["judge", "on_step_end", "poll", "rewind?", "save?", "save", "on_save",
                           "final", "on_train_end"]  # the periodic save; after the rewind, the end at step 8
    assert order.at(10) == ["judge", "on_step_end", "poll", "rewind?", "save?"]  # one spiking step: no rewind yet
    assert order.at(11) == ["judge", "on_step_end", "poll", "rewind?", "rewind"]  # no save of a spiking step
    assert state.batch_count == 8 and trainer.batch_skipper.skip_batches == {9, 10}
    assert sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == [4, 8]
    (rewind,) = [r for r in records(tmp_path, "spike") if r["kind"] == "rewind"]
    assert rewind["step"] == 8 and rewind["from_step"] == 11 and rewind["skip_batches"] == [9, 10]
    assert trainer.rewinder.rewinds == 1 and trainer.health.spike_streak == []


class Replicas:
    """One replica group whose vote refuses the commit of the `refuse`-th attempt (its peer was lost)."""

    replica_id, group_size, participants = 0, 1, 1

    def __init__(self, refuse: int):
        self.refuse, self.commits, self.error, self.closed = refuse, 0, None, False

    def begin_step(self) -> bool:
        return False

    def average_gradients(self, params) -> None:
        pass

    def commit(self) -> bool:
        self.commits += 1
        self.error = "peer lost" if self.commits == self.refuse else None
        return self.error is None

    def step_metrics(self) -> dict:
        return {"ft/participants": self.participants}

    def close(self) -> None:
        self.closed = True


def test_a_step_the_replicas_did_not_commit_trains_the_same_batch_again(tmp_path):
    plain = make(tmp_path, "plain", 5)
    plain.train()
    retried = make(tmp_path, "retried", 5)
    retried.replicas = Replicas(refuse=3)  # the third step's first attempt is not committed
    state = retried.train()

    assert retried.replicas.commits == 6 and retried.replicas.closed
    assert (state.batch_count, state.step_count) == (5, 5)
    losses = {n: [r["loss"] for r in records(tmp_path, n) if r["kind"] == "train"] for n in ("plain", "retried")}
    assert [r["step"] for r in records(tmp_path, "retried") if r["kind"] == "train"] == [1, 2, 3, 4, 5]
    assert losses["retried"] == losses["plain"]  # bitwise: the dropped attempt left no trace
    for (name, a), b in zip(plain.model.named_parameters(), retried.model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("sets", [
    ("model.mtp={'depth': 2, 'loss_weight': 0.5}", "data.seq_len=64"),  # the dropped attempt's depth sums counted
    ("model_type=INTERNLM_MoE", "model.num_experts=4", "moe.top_k=2", "moe.noisy_gate_policy=Jitter",
     "data.seq_len=64")], ids=["mtp", "moe_noisy_router"])  # the retry drew other router noise than one attempt
def test_a_retried_step_reports_the_metrics_of_one_attempt(tmp_path, sets):
    """Every value of a retried step's record is the plain run's: model.mtp's `mtp_loss`, and a noisy MoE router's
    loss, gradient norm and load metrics (the random generators go back with the batch)."""
    make(tmp_path, "plain", 3, *sets).train()
    retried = make(tmp_path, "retried", 3, *sets)
    retried.replicas = Replicas(refuse=2)  # the second step's first attempt is not committed
    retried.train()
    timing = ("time/", "step_time", "tgs", "tflops", "mfu", "ft/")
    plain, again = ([{k: v for k, v in r.items() if not k.startswith(timing)} for r in records(tmp_path, n)
                     if r["kind"] == "train"] for n in ("plain", "retried"))
    assert retried.replicas.commits == 4 and {"mtp_loss", "moe/aux_loss"} & set(plain[1])
    assert again == plain
