"""Nothing corrupt is loaded, nothing poisoned is saved: every file's crc32 in the marker, verified before a load; a
corrupt newest checkpoint is rejected (with an alert) and the one before it resumed; no save during an inf/nan
streak; a rewind rejects what was saved after the spike began."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from internlm_core.checkpoint import (MARKER, REJECTED, CheckpointManager, Checkpointer, CorruptCheckpoint,
                                      LocalStorage, SaveDecision, file_crc32, latest_checkpoint)
from internlm_core.config import load_config

ROOT = Path(__file__).resolve().parents[2]


class Alerts:
    def __init__(self):
        self.sent: list[tuple[str, str, str]] = []

    def send(self, subject: str, content: str, level: str = "error") -> None:
        self.sent.append((subject, content, level))


class Counter:
    """Stateful: survives a restart through the checkpoint (content "sampler")."""

    def __init__(self):
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = int(sd["n"])


def manager(tmp_path: Path, *sets: str) -> tuple[CheckpointManager, torch.nn.Module, Counter, Alerts]:
    cfg = load_config(ROOT / "configs/tiny.py", ["ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder={tmp_path / 'ckpt'}",
                                                 "ckpt.async_upload=False", *sets]).ckpt
    alerts = Alerts()
    m = CheckpointManager(cfg, alerts=alerts)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    m.register_model(model, torch.optim.AdamW(model.parameters()))
    counter = Counter()
    m.register("counter", counter, content="sampler")
    return m, model, counter, alerts


def save(m: CheckpointManager, model: torch.nn.Module, counter: Counter, step: int) -> None:
    with torch.no_grad():
        model.weight.fill_(float(step))
    counter.n = step
    m.save(step, "test")
    assert m.wait().ok


def flip(path: Path, n: int = 64) -> None:
    """n bytes in the middle of the file inverted: same size, marker intact."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + n] = bytes(b ^ 0xFF for b in data[mid:mid + n])
    path.write_bytes(bytes(data))


def test_marker_records_a_crc32_of_every_file(tmp_path):
    m, model, counter, _ = manager(tmp_path)
    save(m, model, counter, 5)
    marker = json.loads((tmp_path / "ckpt/5" / MARKER).read_text())
    assert marker["checksum"] == "crc32"
    assert sorted(marker["checksums"]) == sorted(marker["files"]) == [".metadata", "__0_0.distcp", "config.yaml",
                                                                      "meta.json"]
    for name, crc in marker["checksums"].items():
        assert crc == file_crc32(tmp_path / "ckpt/5" / name)
    m.close()


def test_corrupt_newest_checkpoint_falls_back_to_the_one_before_with_an_alert(tmp_path):
    m, model, counter, _ = manager(tmp_path)
    save(m, model, counter, 10)
    save(m, model, counter, 20)
    m.close()
    flip(tmp_path / "ckpt/20/__0_0.distcp")
    assert latest_checkpoint(LocalStorage(tmp_path / "ckpt")).step == 20  # sizes and marker look fine

    m2, model2, counter2, alerts = manager(tmp_path)
    res = m2.resume()
    assert res.step == 10 and counter2.n == 10 and torch.all(model2.weight == 10.0)
    rejected = json.loads((tmp_path / "ckpt/20" / REJECTED).read_text())
    assert not (tmp_path / "ckpt/20" / MARKER).exists() and rejected["marker"]["step"] == 20
    assert rejected["reason"].startswith(f"checkpoint {tmp_path / 'ckpt/20'} is corrupt: rank 0: __0_0.distcp has "
                                         "crc32 ")
    assert rejected["reason"].endswith("(bytes changed after it was written)")
    (subject, content, level), = alerts.sent
    assert subject == "corrupt checkpoint: falling back to the one before it" and level == "error"
    assert content == rejected["reason"]
    assert latest_checkpoint(LocalStorage(tmp_path / "ckpt")).step == 10  # the next resume does not look again
    m2.close()


def test_a_named_corrupt_checkpoint_is_an_error_and_old_markers_without_checksums_load(tmp_path):
    m, model, counter, _ = manager(tmp_path)
    save(m, model, counter, 3)
    save(m, model, counter, 4)
    m.close()
    flip(tmp_path / "ckpt/4/.metadata", 8)
    m2, model2, counter2, _ = manager(tmp_path, "ckpt.auto_resume=False")
    with pytest.raises(CorruptCheckpoint, match=r"/ckpt/4 is corrupt: rank 0: \.metadata has crc32 [0-9a-f]{8}, the "
                                                r"marker says [0-9a-f]{8}"):
        m2.load(str(tmp_path / "ckpt/4"))
    marker = json.loads((tmp_path / "ckpt/3" / MARKER).read_text())
    del marker["checksum"], marker["checksums"]  # as written before checksums existed
    (tmp_path / "ckpt/3" / MARKER).write_text(json.dumps(marker))
    assert m2.load(str(tmp_path / "ckpt/3")).step == 3 and counter2.n == 3
    m2.close()


def test_no_save_during_an_inf_nan_streak_and_a_rewind_rejects_what_came_after(tmp_path):
    m, model, counter, alerts = manager(tmp_path, "ckpt.checkpoint_every=10")
    cp = Checkpointer(m)
    for step, why in ((10, None), (20, "loss or gradient inf/nan for 3 step(s) in a row since step 18"), (30, None)):
        with torch.no_grad():
            model.weight.fill_(float(step))
        counter.n = step
        decision = cp.due(step)  # the periodic save (checkpoint_every); `why`: the loss health's veto
        assert decision == SaveDecision("checkpoint_every", "regular")
        cp.save(step, decision, unhealthy=why)
        m.wait()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.is_dir()) == ["10", "30"]
    (subject, content, level), = alerts.sent
    assert subject == "checkpoint at step 20 skipped" and level == "warning"
    assert content == ("checkpoint at step 20 not saved: loss or gradient inf/nan for 3 step(s) in a row since step "
                       "18; the newest complete checkpoint stays the last good one (saves resume once the loss is "
                       "healthy)")
    res = m.rewind(25, "loss spike at steps 25-27")
    assert res.step == 10 and counter.n == 10 and torch.all(model.weight == 10.0)
    assert json.loads((tmp_path / "ckpt/30" / REJECTED).read_text())["reason"] == (
        "loss spike at steps 25-27: checkpoint of step 30 saved at or after step 25")
    assert latest_checkpoint(LocalStorage(tmp_path / "ckpt")).step == 10
    m.close()
