"""`--set` values are read as a config file reads them (Python literals, `dict(...)`, nested), or refused in one
line at load; `train.py --dry-run` checks what a run reads before its first step (evaluation task files)."""

import json

import pytest

from internlm_core.config import config_to_dict, load_config
from internlm_core.config.loader import parse_overrides
from internlm_core.errors import ConfigError
from tests.helpers.launch import ROOT

TASKS = '[dict(name="mmlu", path="tasks.jsonl"), dict(name="arc", path="arc.jsonl")]'
ROPE = 'dict(type="dynamic", factor=2.0)'
WEIGHTS = '{"en": 0.7, "code": 0.3}'


def test_set_literals_equal_the_same_values_in_a_config_file(tmp_path):
    config = tmp_path / "cfg.py"
    config.write_text((ROOT / "configs/tiny.py").read_text() + (
        f"evaluation = dict(tasks={TASKS})\n"
        f"model['rope_scaling'] = {ROPE}\n"
        f"data['dataset_weights'] = {WEIGHTS}\n"
        "monitor = dict(log_every=5, trackers=['wandb', 'mlflow'])\n"))
    from_file = load_config(config)
    from_set = load_config(ROOT / "configs/tiny.py", [f"evaluation.tasks={TASKS}", f"model.rope_scaling={ROPE}",
                                                      f"data.dataset_weights={WEIGHTS}",
                                                      "monitor.trackers=['wandb', 'mlflow']"])
    assert config_to_dict(from_set) == config_to_dict(from_file)
    assert from_set.evaluation.tasks == [{"name": "mmlu", "path": "tasks.jsonl"}, {"name": "arc", "path": "arc.jsonl"}]
    assert from_set.model.rope_scaling == {"type": "dynamic", "factor": 2.0}


@pytest.mark.parametrize("text,value", [
    ("dict(a=[1, dict(b=None)], c=(1, -2.5))", {"a": [1, {"b": None}], "c": (1, -2.5)}),
    ("tuple([1, 2])", (1, 2)), ("[dict()]", [{}]), ("20", 20), ("1e-3", 1e-3), ("True", True),
    ("torch.float32", "torch.float32"), ("byte", "byte"), ("[a, b]", ["a", "b"]),  # YAML's reading, as before
    ("https://h/x?token=abc", "https://h/x?token=abc"), ("null", None),
])
def test_set_values(text, value):
    assert parse_overrides([f"k={text}"]) == [(["k"], value)]


@pytest.mark.parametrize("text,part", [("[dict(name=mmlu)]", "mmlu"), ("__import__('os')", "__import__('os')"),
                                       ("dict(**x)", "dict(**x)")])
def test_set_values_that_call_anything_else_are_refused_in_one_line(text, part):
    with pytest.raises(ConfigError) as e:
        parse_overrides([f"evaluation.tasks={text}"])
    assert str(e.value).startswith(f"--set evaluation.tasks: {part} is not a literal") and "\n" not in str(e.value)


def test_dry_run_reads_the_evaluation_task_files(tmp_path, capsys, monkeypatch):
    import train  # the repository root is on sys.path (pytest's rootdir)

    monkeypatch.chdir(tmp_path)
    base = ["--config", str(ROOT / "configs/tiny.py"), "--dry-run", "--set", "tokenizer=byte"]
    with pytest.raises(ConfigError, match=r"evaluation.tasks\[0\].path: no such task file 'tasks.jsonl'"):
        train.main([*base, f"evaluation.tasks={TASKS}"])
    rows = [{"context": "2 + 2 =", "choices": [" 4", " 5"], "gold": 0}, {"context": "Sky:", "choices": [" blue", " red"],
                                                                         "gold": 0}]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert train.main([*base, 'evaluation.tasks=[dict(name="mmlu", path="tasks.jsonl")]']) == 0
    assert "checked: evaluation: 1 task file(s) read (mmlu), 4 requests" in capsys.readouterr().out
