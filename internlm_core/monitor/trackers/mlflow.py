"""MLflow: one mlflow run per training run, tagged with the run key (a resumed run finds it by the tag and continues
it). Configured by mlflow's own variables (MLFLOW_TRACKING_URI: a server, a database or a file store; credentials,
...). Imported only when `monitor.trackers` names it.

Metric names: metrics.jsonl's, with "." for "/" (`acc/code` is `acc.code`): mlflow's file store keeps each metric
as a file of its name, so `acc` and `acc/code` could not both exist there."""

from __future__ import annotations

import os
import time
from typing import Any, Optional

from .base import RunInfo, flatten

RUN_KEY_TAG = "internlm_core_run_id"
_PARAM_CHARS = 6000  # mlflow's longest parameter value
_BATCH = 1000        # mlflow's most metrics in one log_batch


def metric_name(key: str) -> str:
    """The mlflow name of a metrics.jsonl key (see the module docstring)."""
    return key.replace("/", ".")


class MlflowTracker:
    """The `Tracker` for mlflow (see base.py)."""

    name = "mlflow"

    def __init__(self) -> None:
        self._client: Optional[Any] = None
        self._run_id = ""

    def prepare(self) -> None:
        import mlflow.tracking  # noqa: F401 - the optional dependency, only here

    def open(self, run: RunInfo) -> str:
        # mlflow's HTTP client retries a refused connection for minutes by default; bounded here unless the user set
        # them (the tracker's thread gives up after run.timeout_s anyway)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, int(run.timeout_s))))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        from mlflow.tracking import MlflowClient

        client = MlflowClient()
        exp = client.get_experiment_by_name(run.project)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(run.project)
        found = client.search_runs([exp_id], filter_string=f"tags.{RUN_KEY_TAG} = '{run.key}'", max_results=1)
        if found:
            self._run_id = found[0].info.run_id
            client.update_run(self._run_id, status="RUNNING")
        else:
            self._run_id = client.create_run(exp_id, run_name=run.name, tags={RUN_KEY_TAG: run.key}).info.run_id
            self._log_config(client, run.config)
        self._client = client
        return f"{client.tracking_uri} experiment {run.project!r} run {self._run_id}"

    def _log_config(self, client: Any, config: dict) -> None:
        """The config once, as parameters (dotted keys) and as config.json among the run's artifacts."""
        from mlflow.entities import Param

        params = [Param(k, str(v)[:_PARAM_CHARS]) for k, v in flatten(config).items()]
        for i in range(0, len(params), 100):  # mlflow's most parameters in one log_batch
            client.log_batch(self._run_id, params=params[i:i + 100])
        client.log_dict(self._run_id, config, "config.json")

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(metric_name(k), v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), _BATCH):
            self._client.log_batch(self._run_id, metrics=metrics[i:i + _BATCH])

    def close(self) -> None:
        if self._client is not None:
            self._client.set_terminated(self._run_id, "FINISHED")
            self._client = None
