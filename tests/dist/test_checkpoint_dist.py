"""Checkpoints under torchrun (gloo, 2 processes): SIGKILL and auto-resume bitwise with 2 data-parallel ranks; a
checkpoint saved by 2 processes (FSDP-sharded, or tensor parallel) loads on 1 and one saved by 1 loads on 2, with
identical weights and optimizer state.

Run as a script (`python -m torch.distributed.run ... tests/dist/test_checkpoint_dist.py OUT --config ...`) this file
is the driver of the resharding test: it builds the trainer as train.py does (which loads the checkpoint), writes the
full (gathered) model and optimizer state right after loading and again after training.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import read_metrics, run_train

pytestmark = pytest.mark.slow

ME = "tests/dist/test_checkpoint_dist.py"
STEPS = 20


def output(p) -> str:
    return p.stdout[-4000:] + p.stderr[-4000:]


def train_args(run: Path, ckpt: Path, *extra: str) -> list[str]:
    return ["--config", "configs/tiny.py", "--run-dir", str(run), "--set", f"data.total_steps={STEPS}",
            "data.valid_every=0", "monitor.tensorboard=False", "monitor.log_every=5", "ckpt.enable_save_ckpt=True",
            f"ckpt.save_ckpt_folder={ckpt}", "ckpt.checkpoint_every=5", *extra]


def test_two_ranks_sigkill_then_auto_resume_is_bitwise(tmp_path):
    from internlm_core.checkpoint.faults import ENV as FAULT_ENV
    ref = run_train(train_args(tmp_path / "ref", tmp_path / "ref_ckpt"), nproc=2)
    assert ref.returncode == 0, output(ref)
    ref_loss = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "ref")}
    assert sorted(ref_loss) == list(range(1, STEPS + 1))

    ckpt = tmp_path / "ckpt"
    p = run_train(train_args(tmp_path / "killed", ckpt), nproc=2, extra_env={FAULT_ENV: "kill_after_commit@10"})
    assert p.returncode != 0 and "Signal 9 (SIGKILL)" in p.stdout + p.stderr, output(p)
    assert sorted((ckpt / "10").glob("__*_0.distcp")) == [ckpt / "10/__0_0.distcp", ckpt / "10/__1_0.distcp"]
    meta = json.loads((ckpt / "10/meta.json").read_text())  # each data-parallel rank's loader state, recorded
    assert meta["layout"]["dp"] == 2 and meta["data_state"]["data"]["dp_ranks_agree"] is True
    assert {k: v["rows_consumed"] for k, v in meta["data_state"]["data"]["per_dp_rank"].items()} == \
        {"dp0": 10 * 2 * 2, "dp1": 10 * 2 * 2}

    q = run_train(train_args(tmp_path / "resumed", ckpt), nproc=2)
    assert q.returncode == 0, output(q)
    assert f"loaded {ckpt / '10'} (step 10, regular" in q.stdout and "same layout: exact resume" in q.stdout
    resumed = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(11, STEPS + 1))
    assert [r["loss"] for r in resumed] == [ref_loss[s] for s in range(11, STEPS + 1)]
    assert resumed[-1]["num_consumed_tokens"] == STEPS * 2 * 2 * 512


# ---- resharding: N processes save, M load -------------------------------------------------------------------------

def driver_args(run: Path, ckpt: Path, steps: int, *extra: str) -> list[str]:
    return ["--config", "configs/tiny.py", "--run-dir", str(run), "--set", f"data.total_steps={steps}",
            "data.valid_every=0", "monitor.tensorboard=False", "ckpt.enable_save_ckpt=True",
            f"ckpt.save_ckpt_folder={ckpt}", "ckpt.checkpoint_every=1000", *extra,
            # with a load_ckpt_info: auto_resume off (on, as in InternLM, it replaces load_ckpt_info)
            *(["ckpt.auto_resume=False"] if any(e.startswith("ckpt.load_ckpt_info=") for e in extra) else [])]


def run_driver(out: Path, args: list[str], nproc: int):
    p = run_train([str(out), *args], nproc=nproc, script=ME)
    assert p.returncode == 0, output(p)
    return p


def assert_same_state(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys() and len(a["model"]) > 20
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["optimizer"].keys() == b["optimizer"].keys() and len(a["optimizer"]) > 40
    for k in a["optimizer"]:
        assert torch.equal(a["optimizer"][k], b["optimizer"][k]), k
    assert a["state"]["batch_count"] == b["state"]["batch_count"]
    assert a["data"]["rows_consumed"] == b["data"]["rows_consumed"]


def test_checkpoint_loads_on_another_layout(tmp_path):
    """Tensor parallel 2 → one process → FSDP over 2 data-parallel ranks, each load checked against the state that
    was saved, each run then training on from the step it loaded."""
    def info(path: Path) -> str:
        return f"ckpt.load_ckpt_info={{'path': '{path}', 'content': ('all',)}}"

    run_driver(tmp_path / "a", driver_args(tmp_path / "run_a", tmp_path / "ckpt_a", 6, "parallel.tensor=2"), 2)
    p = run_driver(tmp_path / "b", driver_args(tmp_path / "run_b", tmp_path / "ckpt_b", 8, info(tmp_path / "ckpt_a/6")), 1)
    assert "layout changed from" in p.stdout
    q = run_driver(tmp_path / "c", driver_args(tmp_path / "run_c", tmp_path / "ckpt_c", 10, "parallel.zero1=-1",
                                               info(tmp_path / "ckpt_b/8")), 2)
    assert "layout changed from" in q.stdout

    def state(name: str) -> dict:
        return torch.load(tmp_path / f"{name}.pt", weights_only=True)

    assert_same_state(state("a.trained"), state("b.loaded"))  # saved by 2 (TP), loaded on 1
    assert_same_state(state("b.trained"), state("c.loaded"))  # saved by 1, loaded on 2 (FSDP)
    assert state("b.loaded")["data"]["rows_consumed"] == 6 * 2  # TP 2 is one data-parallel rank
    assert state("c.loaded")["data"]["rows_consumed"] == 6 * 2 + 2 * 2
    assert [r["step"] for r in read_metrics(tmp_path / "run_b")] == [7, 8]
    assert [r["step"] for r in read_metrics(tmp_path / "run_c")] == [9, 10]
    assert state("c.trained")["data"]["rows_consumed"] == 6 * 2 + 2 * 2 + 2 * 2 * 2


def _dump(trainer, path: str, rank: int) -> None:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True)
    msd = get_model_state_dict(trainer.model, options=opts)
    osd = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=opts)
    if rank == 0:
        torch.save({"model": msd, "optimizer": {k: v for k, v in osd.items() if isinstance(v, torch.Tensor)},
                    "state": trainer.state.state_dict(), "data": trainer.train_loader.state_dict()}, path)


def driver(out: str, argv: list[str]) -> None:
    """train.py's main, dumping the full state after loading (if a checkpoint was loaded) and after training."""
    import train
    from internlm_core.callbacks import TrainerCallback

    class Dump(TrainerCallback):
        def on_train_start(self, trainer):
            if trainer.checkpoint_manager.loaded is not None:  # (reading a fresh optimizer's state would initialize it)
                _dump(trainer, f"{out}.loaded.pt", trainer.rank)

        def on_train_end(self, trainer):
            _dump(trainer, f"{out}.trained.pt", trainer.rank)

    train.main(argv, extra_callbacks=[Dump()])


if __name__ == "__main__":
    driver(sys.argv[1], sys.argv[2:])
