"""The README's config reference is generated from the schema and up to date."""

import dataclasses
import typing

import pytest

from internlm_core.config import schema
from internlm_core.config.reference import BEGIN, END, render, replace_between_markers, sections
from tests.helpers.launch import ROOT, run_script


def all_keys(cls=schema.Config, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        sub = tp if dataclasses.is_dataclass(tp) else (inner[0] if inner else None)
        if sub is not None:
            yield from all_keys(sub, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f.metadata.get("help", "")


def test_every_schema_key_is_in_the_reference_with_its_help():
    text = render()
    keys = list(all_keys())
    assert len(keys) > 100
    for key, help_text in keys:
        assert help_text, f"{key} has no metadata['help']"
        row = next((ln for ln in text.splitlines() if ln.startswith(f"| `{key}` |")), None)
        assert row is not None, key
        assert help_text.replace("|", "\\|") in row, key


def test_defaults_are_rendered():
    rows = {k: (t, d) for _, _, rs in sections() for k, t, d, _ in rs}
    assert rows["data.seq_len"] == ("int", "2048")
    assert rows["model.mlp_ratio"] == ("float", "8/3")
    assert rows["ckpt.load_ckpt_info.content"][1] == "('all',)"
    assert rows["grad_scaler.initial_scale"][1] == "2**16"
    assert rows["hybrid_zero_optimizer.reduce_bucket_size"][1] == "512 * 1024**2"
    assert rows["ckpt.load_ckpt_info"] == ("LoadCkptInfo or None", "None")


def test_readme_reference_is_up_to_date():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme.count(BEGIN) == 1 and readme.count(END) == 1
    assert replace_between_markers(readme, render()) == readme, \
        "README.md is stale: python -m internlm_core.config.reference --update README.md"


def test_check_and_update_cli(tmp_path):
    stale = tmp_path / "README.md"
    stale.write_text(f"# title\n\n{BEGIN}\nold text\n{END}\n\nafter\n")
    cli = "-m internlm_core.config.reference"
    p = run_script(cli, ["--check", str(stale)])
    assert p.returncode == 1 and "out of date" in p.stderr
    p = run_script(cli, ["--update", str(stale)])
    assert p.returncode == 0
    text = stale.read_text()
    assert text.startswith("# title\n\n") and text.endswith(f"{END}\n\nafter\n") and "old text" not in text
    assert "| `data.seq_len` | int | `2048` |" in text
    p = run_script(cli, ["--check", str(stale)])
    assert p.returncode == 0


def test_missing_markers_are_reported():
    with pytest.raises(ValueError, match="markers of the config reference are missing"):
        replace_between_markers("# no markers\n", render())
