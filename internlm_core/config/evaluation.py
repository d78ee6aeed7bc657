"""The rules of the `evaluation` section (schema.EvaluationConfig): its task list, normalized to dicts."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError


def check_evaluation(ev: Any) -> None:
    """Each task a dict(name=str, path=str) (a bare path names the task by its file name), names unique; counts
    positive. The files themselves are read when the run starts (a checkpoint's config may name files elsewhere)."""
    if not isinstance(ev.tasks, (list, tuple)):
        raise ConfigError(f"evaluation.tasks: expected a list of dict(name=..., path=...jsonl), got {ev.tasks!r}")
    tasks = []
    for i, t in enumerate(ev.tasks):
        key = f"evaluation.tasks[{i}]"
        if isinstance(t, str):
            t = {"name": t.rsplit("/", 1)[-1].rsplit(".", 1)[0], "path": t}
        if not isinstance(t, dict) or set(t) - {"name", "path"} or not isinstance(t.get("path"), str):
            raise ConfigError(f"{key}: expected dict(name=str, path=str) (a .jsonl task file), got {t!r}")
        name = t.get("name") or t["path"].rsplit("/", 1)[-1].rsplit(".", 1)[0]
        if not isinstance(name, str) or not name or "/" in name:
            raise ConfigError(f"{key}.name: expected a non-empty name without '/', got {name!r}")
        if name in [x["name"] for x in tasks]:
            raise ConfigError(f"{key}.name: {name!r} is taken by an earlier task; names must be unique")
        tasks.append({"name": name, "path": t["path"]})
    ev.tasks = tasks
    for key in ("eval_every", "batch_size"):
        v = getattr(ev, key)
        if v < (1 if key == "batch_size" else 0):
            raise ConfigError(f"evaluation.{key}: expected {'a positive' if key == 'batch_size' else 'a non-negative'} "
                              f"integer, got {v}")
