"""monitor.trackers: wandb (offline) and mlflow (a file store) receive every metrics.jsonl record from rank 0, the
config once with its secrets redacted; a resumed run continues the same tracker runs; an mlflow server that refuses
connections costs no step and one warning."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.helpers.launch import read_metrics, run_train
from tests.helpers.wandb_log import offline_runs, read_run

pytestmark = pytest.mark.slow

SECRET = "sekret-token-123456"
WEBHOOK = f"http://127.0.0.1:9/hook?token={SECRET}"  # a secret in the config (port 9: nothing listens)


def args(run: Path, ckpt: Path, steps: int, trackers: str, *extra: str) -> list[str]:
    return ["--config", "configs/tiny.py", "--run-dir", str(run), "--set", f"data.total_steps={steps}",
            "data.seq_len=64", "data.valid_every=0", "monitor.tensorboard=False", f"monitor.trackers={trackers}",
            "ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder={ckpt}", "ckpt.checkpoint_every=3", *extra]


def output(p) -> str:
    return p.stdout[-4000:] + p.stderr[-4000:]


def numbers(rec: dict) -> dict[str, float]:
    return {k: float(v) for k, v in rec.items() if k not in ("kind", "step") and not isinstance(v, str)}


def mlflow_runs(store: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{store}")
    exp = client.get_experiment_by_name("tiny")
    return client, client.search_runs([exp.experiment_id])


def test_both_trackers_get_every_record_and_a_resume_continues_their_runs(tmp_path, monkeypatch):
    from internlm_core.monitor.trackers.mlflow import RUN_KEY_TAG, metric_name

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 keeps the file store behind this switch
    store, ckpt = tmp_path / "mlruns", tmp_path / "ckpt"
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "MLFLOW_TRACKING_URI": f"file:{store}",
           "MLFLOW_ALLOW_FILE_STORE": "true"}
    trackers = '["wandb","mlflow"]'
    p = run_train(args(tmp_path / "a", ckpt, 6, trackers, f"monitor.alert.webhook_url={WEBHOOK}"), extra_env=env)
    assert p.returncode == 0, output(p)
    p = run_train(args(tmp_path / "b", ckpt, 9, trackers), extra_env=env)  # auto_resume from step 6
    assert p.returncode == 0, output(p)
    first, second = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["step"] for r in first + second] == list(range(1, 10))

    # mlflow: one run holding both processes' records, per step equal to metrics.jsonl
    client, runs = mlflow_runs(store)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    run = runs[0]
    logged: dict[str, dict[int, float]] = {}  # per metric, {step: value}, read once
    for key in run.data.metrics:
        logged[key] = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
    for rec in first + second:
        assert {k: logged[metric_name(k)][rec["step"]] for k in numbers(rec)} == numbers(rec), rec["step"]
    params = run.data.params
    assert params["model.hidden_size"] == "128" and params["monitor.alert.webhook_url"] == "<redacted>"
    assert not any(SECRET in v for v in params.values())

    # wandb: two offline runs with the same id (the key the checkpoint kept), the first one with the config
    files = offline_runs(tmp_path)
    assert len(files) == 2
    a, b = read_run(files[0]), read_run(files[1])
    assert a["run_id"] == b["run_id"] == run.data.tags[RUN_KEY_TAG]
    assert a["config"]["model"]["hidden_size"] == 128
    assert a["config"]["monitor"]["alert"]["webhook_url"] == "<redacted>" and SECRET not in str(a["config"])
    assert "model" not in b["config"]  # logged once, when the run started
    for rec, hist in [(r, a["history"]) for r in first] + [(r, b["history"]) for r in second]:
        assert hist[rec["step"]] == numbers(rec)
    assert sorted(a["history"]) == [1, 2, 3, 4, 5, 6] and sorted(b["history"]) == [7, 8, 9]


def test_an_mlflow_server_that_refuses_connections_costs_no_step_and_warns_once(tmp_path):
    with socket.socket() as s:  # a loopback port nothing listens on: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    p = run_train(args(tmp_path / "run", tmp_path / "ckpt", 6, "mlflow", "monitor.tracker_timeout=10"),
                  extra_env=env)
    assert p.returncode == 0, output(p)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]
    text = p.stdout + p.stderr
    warnings = [line for line in text.splitlines() if "WARNING" in line and "tracker" in line]
    assert len(warnings) == 1, warnings
    assert "tracker mlflow: connecting failed" in warnings[0] and "training goes on without it" in warnings[0]
