"""CheckpointManager in one process, through the real wiring (build_trainer): what is saved comes back exactly,
auto_resume's choice, retention, mismatch messages, refusal to unpickle, model-only loads."""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from internlm_core.checkpoint import MARKER, CheckpointManager, LocalStorage, find_complete_checkpoints, latest_checkpoint
from internlm_core.checkpoint.safe_dcp import read_dcp_metadata
from internlm_core.checkpoint.integrity import file_crc32
from internlm_core.config import load_config
from internlm_core.distributed import LaunchInfo
from internlm_core.errors import CheckpointError
from internlm_core.trainer.build import build_trainer

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = LaunchInfo("none", 0, 1, 0, torch.device("cpu"), None)
SEQ = 64  # short rows: what these tests check does not depend on the shape


def build(tmp_path: Path, run: str, steps: int, *sets: str, ckpt: Path | None = None):
    """A real trainer of configs/tiny.py that saves into `ckpt` (default tmp_path/ckpt) and auto-resumes from it
    (with a load_ckpt_info: loads that instead, auto_resume off as InternLM needs it)."""
    ckpt = ckpt or tmp_path / "ckpt"
    if any(s.startswith("ckpt.load_ckpt_info=") for s in sets) and not any(s.startswith("ckpt.auto_resume=")
                                                                           for s in sets):
        sets = (*sets, "ckpt.auto_resume=False")
    cfg = load_config(ROOT / "configs/tiny.py", [
        f"data.total_steps={steps}", f"data.seq_len={SEQ}", "data.valid_every=0", "monitor.tensorboard=False", "monitor.log_every=1000",
        "ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder={ckpt}", "ckpt.checkpoint_every=1000", *sets])
    (tmp_path / run).mkdir(parents=True, exist_ok=True)
    return build_trainer(cfg, LAUNCH, tmp_path / run)


def load_info(path: Path, *content: str) -> str:
    return f"ckpt.load_ckpt_info={{'path': '{path}', 'content': {tuple(content)!r}}}"


def params(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def optim_tensors(trainer) -> dict[str, torch.Tensor]:
    sd = trainer.optimizer.state_dict()
    return {f"{i}.{k}": v.clone() for i, st in sd["state"].items() for k, v in st.items()}


def draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


@pytest.mark.parametrize("async_upload", [True, False])
def test_resume_restores_every_registered_state(tmp_path, async_upload):
    a = build(tmp_path, "a", 3, f"ckpt.async_upload={async_upload}")
    for _ in range(5):  # move every RNG away from the seeded state, so that restoring it is visible
        draws()
    a.train()  # save_at_end: checkpoint 3
    assert (tmp_path / "ckpt/3" / MARKER).is_file()
    expect = params(a), optim_tensors(a), a.lr_scheduler.state_dict(), a.beta2_scheduler.state_dict(), \
        a.state.state_dict(), a.train_loader.state_dict(), draws()

    b = build(tmp_path, "b", 3, f"ckpt.async_upload={async_upload}")
    got = params(b), optim_tensors(b), b.lr_scheduler.state_dict(), b.beta2_scheduler.state_dict(), \
        b.state.state_dict(), b.train_loader.state_dict(), draws()
    for name in expect[0]:
        assert torch.equal(expect[0][name], got[0][name]), name
    assert expect[1].keys() == got[1].keys() and len(expect[1]) > 0
    for name in expect[1]:
        assert torch.equal(expect[1][name], got[1][name]), name
    assert got[2] == expect[2] and got[2]["last_step"] == 3
    assert got[3] == expect[3]
    ts_a, ts_b = dict(expect[4]), dict(got[4])
    ts_a.pop("tensorboard_folder"), ts_b.pop("tensorboard_folder")
    assert ts_b == ts_a and ts_b["batch_count"] == 3
    assert got[5] == expect[5] and got[5]["rows_consumed"] == 3 * 2
    assert got[6] == expect[6]
    assert b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]
    assert b.checkpoint_manager.loaded.step == 3 and b.checkpoint_manager.loaded.same_layout


def test_async_save_stages_a_copy_before_returning(tmp_path):
    a = build(tmp_path, "a", 2, "ckpt.save_at_end=False")
    a.train()
    saved = params(a)
    m = a.checkpoint_manager
    m.save(7, "test")
    with torch.no_grad():  # the loop goes on while the shards are written: the checkpoint must not see this
        for p in a.model.parameters():
            p.add_(1.0)
    res = m.wait()
    assert res.ok and res.step == 7 and res.blocked_s <= res.total_s
    b = build(tmp_path, "b", 7)
    assert b.checkpoint_manager.loaded.step == 7
    got = params(b)
    for name in saved:
        assert torch.equal(got[name], saved[name]), name


def test_auto_resume_picks_newest_complete_including_snapshots(tmp_path, caplog):
    sets = ("ckpt.checkpoint_every=4", "ckpt.oss_snapshot_freq=2", "ckpt.save_at_end=False")
    a = build(tmp_path, "a", 6, *sets)
    a.train()  # snapshot 2 → slot 0, regular 4, snapshot 6 → slot 1
    dest = LocalStorage(tmp_path / "ckpt")
    assert dest.read_marker("snapshot/0")["step"] == 2 and dest.read_marker("snapshot/1")["step"] == 6
    assert [(r.name, r.step) for r in find_complete_checkpoints(dest)] == [("snapshot/0", 2), ("4", 4), ("snapshot/1", 6)]
    assert latest_checkpoint(dest).name == "snapshot/1"

    (tmp_path / "ckpt/snapshot/1" / MARKER).unlink()  # as if killed while writing slot 1
    assert latest_checkpoint(dest).name == "4"
    shard = tmp_path / "ckpt/4/__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])  # a truncated shard: the marker's sizes disagree
    assert latest_checkpoint(dest).name == "snapshot/0"
    assert "checkpoint {} is damaged (__0_0.distcp has".format(tmp_path / "ckpt/4") in caplog.text

    b = build(tmp_path, "b", 6, *sets)
    assert b.checkpoint_manager.loaded.url == str(tmp_path / "ckpt/snapshot/0") and b.state.batch_count == 2
    b.train()  # regular 4 replaces the damaged one; snapshot 6 goes into the slot not holding the newest snapshot
    assert dest.read_marker("4")["step"] == 4 and dest.verify("4", dest.read_marker("4")) is None
    assert dest.read_marker("snapshot/1")["step"] == 6 and dest.read_marker("snapshot/0")["step"] == 2
    assert not list((tmp_path / "ckpt").rglob(".trash-*"))  # the replaced folder of 4 was deleted


def test_keep_last_k_keeps_newest_and_just_written(tmp_path):
    ckpt = tmp_path / "ckpt"
    leftover = ckpt / "3"
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"partial")  # an incomplete folder of a crashed run: never touched
    a = build(tmp_path, "a", 4, "ckpt.checkpoint_every=2", "ckpt.oss_snapshot_freq=3", "ckpt.keep_last_k=1")
    a.train()  # regular 2, snapshot 3, regular 4 (removes 2)
    dest = LocalStorage(ckpt)
    assert sorted(dest.list_names()) == ["3", "4", "snapshot/0"]
    assert [r.name for r in find_complete_checkpoints(dest)] == ["snapshot/0", "4"]

    # a complete checkpoint with a higher step (copied from elsewhere) is the newest: kept, and so is the one just
    # written; every other regular one goes
    shutil.copytree(ckpt / "4", ckpt / "100")
    marker = json.loads((ckpt / "100" / MARKER).read_text())
    (ckpt / "100" / MARKER).write_text(json.dumps(dict(marker, step=100)))
    b = build(tmp_path, "b", 2, "ckpt.checkpoint_every=2", "ckpt.keep_last_k=1", "ckpt.auto_resume=False")
    b.train()
    assert [r.name for r in find_complete_checkpoints(dest)] == ["2", "snapshot/0", "100"]


def test_mismatched_shapes_name_parameter_and_both_shapes(tmp_path):
    build(tmp_path, "a", 1).train()
    path = tmp_path / "ckpt/1"
    with pytest.raises(CheckpointError) as e:
        build(tmp_path, "b", 1, "model.hidden_size=64", load_info(path, "model"), ckpt=tmp_path / "other")
    assert str(e.value) == (
        f"checkpoint {path} does not match the model: "
        "parameter 'layers.0.attention.wk.bias' has shape (128,) in the checkpoint but (64,) in the model; "
        "parameter 'layers.0.attention.wk.weight' has shape (128, 128) in the checkpoint but (64, 64) in the model; "
        "parameter 'layers.0.attention.wo.bias' has shape (128,) in the checkpoint but (64,) in the model; "
        "parameter 'layers.0.attention.wo.weight' has shape (128, 128) in the checkpoint but (64, 64) in the model; "
        "parameter 'layers.0.attention.wq.bias' has shape (128,) in the checkpoint but (64,) in the model; "
        "parameter 'layers.0.attention.wq.weight' has shape (128, 128) in the checkpoint but (64, 64) in the model; "
        "and 23 more")


def test_missing_keys_are_named(tmp_path):
    build(tmp_path, "a", 1, "model.qkv_bias=False").train()
    path = tmp_path / "ckpt/1"
    with pytest.raises(CheckpointError) as e:  # this model has biases the checkpoint lacks
        build(tmp_path, "b", 1, load_info(path, "all"), ckpt=tmp_path / "other")
    assert str(e.value).startswith(
        f"checkpoint {path} does not match the model: "
        "parameter 'layers.0.attention.wk.bias' (shape (128,)) is missing from the checkpoint; "
        "parameter 'layers.0.attention.wo.bias' (shape (128,)) is missing from the checkpoint;")
    with pytest.raises(CheckpointError) as e:  # and the other way round
        build(tmp_path, "c", 1, "model.qkv_bias=False", load_info(tmp_path / "other", "all"), ckpt=tmp_path / "x")
    assert "no complete checkpoint there" in str(e.value)


class _Exploit:
    """Pickles to a call of os.system: what a crafted checkpoint would carry."""

    def __init__(self, flag: Path):
        self.flag = flag

    def __reduce__(self):
        return os.system, (f"touch {self.flag}",)

    def __deepcopy__(self, memo):  # async staging deep-copies the state; only unpickling may run the command
        return self


class _Holder:
    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"x": self.value}

    def load_state_dict(self, sd):
        self.value = sd["x"]


def test_crafted_dcp_index_is_not_unpickled(tmp_path):
    build(tmp_path, "a", 1).train()
    folder = tmp_path / "ckpt/1"
    flag = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(_Exploit(flag)))
    marker = json.loads((folder / MARKER).read_text())  # the attacker controls every file, the marker too
    marker["files"][".metadata"] = (folder / ".metadata").stat().st_size
    marker["checksums"][".metadata"] = file_crc32(folder / ".metadata")
    (folder / MARKER).write_text(json.dumps(marker))
    b = build(tmp_path, "b", 1, "ckpt.auto_resume=False")
    with pytest.raises(CheckpointError) as e:
        b.checkpoint_manager.load(str(folder))
    assert str(e.value) == (f"{folder / '.metadata'}: not a valid DCP index (UnpicklingError: refusing to load "
                            f"global posix.system); refusing to load it")
    assert not flag.exists()


def test_crafted_item_is_not_unpickled(tmp_path):
    flag = tmp_path / "pwned"
    a = build(tmp_path, "a", 1, "ckpt.save_at_end=False")
    a.checkpoint_manager.register("extra", _Holder(_Exploit(flag)), content="sampler")
    a.checkpoint_manager.save(1, "test")
    assert a.checkpoint_manager.wait().ok and not flag.exists()
    b = build(tmp_path, "b", 1, "ckpt.auto_resume=False")
    holder = _Holder(None)
    b.checkpoint_manager.register("extra", holder, content="sampler")
    with pytest.raises(CheckpointError) as e:
        b.checkpoint_manager.load(str(tmp_path / "ckpt/1"))
    assert str(e.value).startswith("checkpoint item 'extra.x': refusing to load it (UnpicklingError: ")
    assert not flag.exists() and holder.value is None
    # the threat is real: DCP's stock planner would have run the command
    import torch.distributed.checkpoint as dcp
    dcp.load({"extra": {"x": None}}, checkpoint_id=str(tmp_path / "ckpt/1"), no_dist=True)
    assert flag.exists()


def test_model_only_load_starts_fresh_optimizer_and_schedule(tmp_path):
    a = build(tmp_path, "a", 4)
    a.train()
    fresh = build(tmp_path, "fresh", 4, "ckpt.auto_resume=False", ckpt=tmp_path / "none")
    path = tmp_path / "ckpt/4"

    b = build(tmp_path, "b", 4, load_info(path, "model"), ckpt=tmp_path / "b_ckpt")
    for name, t in params(a).items():
        assert torch.equal(params(b)[name], t), name
    assert len(b.optimizer.state) == 0
    assert b.lr_scheduler.state_dict() == fresh.lr_scheduler.state_dict()
    assert b.optimizer.param_groups[0]["lr"] == fresh.optimizer.param_groups[0]["lr"] != a.optimizer.param_groups[0]["lr"]
    assert b.state.batch_count == 0 and b.train_loader.state_dict()["rows_consumed"] == 0
    assert b.checkpoint_manager.loaded.content == ("model",)

    c = build(tmp_path, "c", 4, load_info(path, "all"), ckpt=tmp_path / "c_ckpt")  # the contrast: everything
    assert len(c.optimizer.state) > 0 and c.state.batch_count == 4
    assert c.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]


def test_auto_resume_first_start_loads_load_ckpt_info_then_resumes_its_own(tmp_path, caplog):
    """auto_resume (the default) with load_ckpt_info: the job's first start, with nothing under save_ckpt_folder
    yet, loads the named weights (InternLM started from random ones); its restart resumes its own checkpoint; a
    path holding nothing (InternLM's placeholder) starts fresh with a warning naming it."""
    a = build(tmp_path, "a", 2)
    a.train()
    info, job = load_info(tmp_path / "ckpt/2", "model"), tmp_path / "job_ckpt"
    b = build(tmp_path, "b", 3, info, "ckpt.auto_resume=True", ckpt=job)
    assert b.checkpoint_manager.loaded.content == ("model",) and b.state.batch_count == 0
    for name, t in params(a).items():
        assert torch.equal(params(b)[name], t), name
    b.train()  # saves step 3 at the end
    c = build(tmp_path, "c", 3, info, "ckpt.auto_resume=True", ckpt=job)
    assert c.checkpoint_manager.loaded.step == 3 and c.state.batch_count == 3
    for name, t in params(b).items():
        assert torch.equal(params(c)[name], t), name
    c.checkpoint_manager.close()
    with caplog.at_level(logging.WARNING):
        d = build(tmp_path, "d", 2, load_info(tmp_path / "nothing", "model"), "ckpt.auto_resume=True",
                  ckpt=tmp_path / "d_ckpt")
    assert d.checkpoint_manager.loaded is None and d.state.batch_count == 0
    assert f"load_ckpt_info {tmp_path / 'nothing'} (internlm_core) not used: nothing there" in caplog.text
    d.checkpoint_manager.close()


def test_optimizer_without_scheduler_keeps_fresh_schedule(tmp_path):
    a = build(tmp_path, "a", 4)
    a.train()
    fresh = build(tmp_path, "fresh", 4, "ckpt.auto_resume=False", ckpt=tmp_path / "none")
    b = build(tmp_path, "b", 4, load_info(tmp_path / "ckpt/4", "model", "optimizer"), ckpt=tmp_path / "b_ckpt")
    assert optim_tensors(b).keys() == optim_tensors(a).keys()
    assert b.optimizer.param_groups[0]["lr"] == fresh.optimizer.param_groups[0]["lr"]
    assert b.state.batch_count == 0


def test_incomplete_checkpoint_is_refused_when_named(tmp_path):
    build(tmp_path, "a", 2).train()
    (tmp_path / "ckpt/2" / MARKER).unlink()
    with pytest.raises(CheckpointError) as e:
        build(tmp_path, "b", 2, load_info(tmp_path / "ckpt/2", "all"), ckpt=tmp_path / "other")
    assert str(e.value) == (f"checkpoint {tmp_path / 'ckpt/2'} is incomplete (no COMPLETE marker): it was "
                            "interrupted while being written; load an older one")


def test_meta_json_records_layout_contents_and_config(tmp_path):
    build(tmp_path, "a", 2).train()
    meta = json.loads((tmp_path / "ckpt/2/meta.json").read_text())
    assert meta["step"] == 2 and meta["num_consumed_tokens"] == 2 * (2 * 2) * SEQ  # steps x (micro_num x micro_bsz) rows x seq_len
    assert meta["layout"] == {"world_size": 1, "dp": 1, "dp_shard": 1, "dp_replicate": 1, "tp": 1, "pp": 1, "zero1": -1}
    assert meta["contents"] == {"model": ["model"], "sampler": ["train_state", "data (one per dp_rank)",
                                                                 "rng (one per rank)", "loss_health",
                                                                 "batch_skipper"],
                                "optimizer": ["optimizer"], "scheduler": ["lr_scheduler", "beta2_scheduler"]}
    assert "other_layout" in meta["resume"] and "hidden_size: 128" in meta["config"]
    assert meta["state"]["train_state"]["batch_count"] == 2 and meta["state"]["lr_scheduler"]["last_step"] == 2
    assert meta["data_state"]["data"]["dp_ranks_agree"] is True
    assert meta["data_state"]["data"]["per_dp_rank"]["dp0"]["rows_consumed"] == 4
    assert (tmp_path / "ckpt/2/config.yaml").read_text() == meta["config"]
    keys = read_dcp_metadata(tmp_path / "ckpt/2").state_dict_metadata
    assert "data.dp0.rows_consumed" in keys and "rng.rank0.torch_cpu" in keys and "train_state.batch_count" in keys


def test_register_rejects_bad_entries():
    m = CheckpointManager(load_config(ROOT / "configs/tiny.py").ckpt)
    with pytest.raises(ValueError):
        m.register("model", _Holder(1), content="sampler")
    with pytest.raises(ValueError):
        m.register("x", _Holder(1), content="weights")
    with pytest.raises(TypeError):
        m.register("y", object(), content="sampler")
    m.register("z", None, content="sampler")  # an absent component (no grad scaler) is skipped
    assert m.registered == {}


class _CopiesOnly(LocalStorage):
    """A folder reached through copies only, as object storage is."""

    def local_path(self, name):
        return None


def test_storage_without_local_path_is_staged_uploaded_and_downloaded(tmp_path, monkeypatch):
    """The manager needs the Storage protocol only: a backend without a local path is written through the staging
    folder (then uploaded file by file, marker last) and read back through a download, as s3:// is."""
    import internlm_core.checkpoint.manager as manager_module
    monkeypatch.setattr(manager_module, "parse_destination", lambda url, *a: _CopiesOnly(url))
    stage = f"ckpt.async_upload_tmp_folder={tmp_path / 'stage'}"
    a = build(tmp_path, "a", 2, stage)
    a.train()
    dest = LocalStorage(tmp_path / "ckpt")
    marker = dest.read_marker("2")
    assert marker["step"] == 2 and dest.verify("2", marker) is None
    assert {".metadata", "__0_0.distcp", "meta.json", "config.yaml"} <= set(marker["files"])
    assert not (tmp_path / "stage/upload/2").exists()  # the staged copy goes once the checkpoint is complete
    b = build(tmp_path, "b", 2, stage)
    assert b.checkpoint_manager.loaded.step == 2 and b.state.batch_count == 2
    for name, t in params(a).items():
        assert torch.equal(params(b)[name], t), name
    assert not list((tmp_path / "stage/download").glob("*"))


@pytest.mark.parametrize("request_value,stop_at,saved", [(5, 5, ["5"]), (-3, 6, ["3", "6"])])
def test_stop_file_requests_are_saved(tmp_path, request_value, stop_at, saved):
    """InternLM's stop file through the StopController: N > 0 saves at N and stops, N < 0 saves at |N| and goes on
    (then the end-of-training save)."""
    stop = tmp_path / "stop"
    t = build(tmp_path, "a", 6, f"ckpt.stop_file_path={stop}")
    stop.write_text(str(request_value))  # after start-up, which resets the file to 0
    t.train()
    assert t.state.batch_count == stop_at
    assert [r.name for r in find_complete_checkpoints(LocalStorage(tmp_path / "ckpt"))] == saved
    assert t.checkpoint_manager.results[0].reason == f"stop file {stop}: {request_value}"
