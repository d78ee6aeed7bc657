"""tools/plot_metrics.py as a user runs it, on metrics.jsonl files in the writer's format."""

import json
import math
import sys

import numpy as np
import pytest

from tests.helpers.launch import ROOT, run_script

sys.path.insert(0, str(ROOT / "tools"))
import plot_metrics  # noqa: E402

C0 = np.array([0x1F, 0x77, 0xB4]) / 255  # matplotlib's first colour: run 1
C1 = np.array([0xFF, 0x7F, 0x0E]) / 255  # second colour: run 2


def write_run(folder, steps, lr, valid_every=10, resume_at=None, truncated=False):
    folder.mkdir(parents=True)
    lines = []

    def train(s, loss):
        return {"kind": "train", "step": s, "loss": loss, "lr": lr * min(1.0, s / 5), "grad_norm": 2.0 / s,
                "tgs": 1000.0 + s, "tflops": 0.1, "mfu": 0.3, "acc": 0.1, "ppl": math.exp(loss)}

    for s in range(1, steps + 1):
        lines.append(train(s, 6.0 / math.sqrt(s)))
        if s % valid_every == 0:
            lines.append({"kind": "valid", "step": s, "valid/code/loss": 5.0 / math.sqrt(s),
                          "valid/code/acc": 0.02 * s, "valid/code/ppl": math.exp(5.0 / math.sqrt(s)),
                          "valid/docs/loss": 5.5 / math.sqrt(s), "valid/docs/acc": 0.01 * s,
                          "valid/docs/ppl": math.exp(5.5 / math.sqrt(s)), "valid_time": 0.1})
    if resume_at is not None:  # a resumed run appends steps it had already written
        for s in range(resume_at + 1, steps + 1):
            lines.append(train(s, 1.0))
    text = "".join(json.dumps(r) + "\n" for r in lines)
    if truncated:
        text += '{"kind": "train", "step": 99, "lo'
    (folder / "metrics.jsonl").write_text(text)


def test_read_run_keeps_latest_record_and_skips_truncated_line(tmp_path):
    write_run(tmp_path / "a", 20, 1e-3, resume_at=15, truncated=True)
    run = plot_metrics.read_run(tmp_path / "a")
    assert [r["step"] for r in run.train] == list(range(1, 21))
    assert run.series("loss")[1][14:] == [6.0 / math.sqrt(15)] + [1.0] * 5
    assert run.skipped_lines == 1
    assert run.valid_datasets() == ["code", "docs"]
    assert run.series("valid/docs/acc", "valid") == ([10, 20], [0.1, 0.2])


def test_two_runs_overlaid_pngs(tmp_path):
    write_run(tmp_path / "exp" / "lr3e-3", 60, 3e-3)
    write_run(tmp_path / "exp" / "lr1e-3", 40, 1e-3)
    out = tmp_path / "plots"
    p = run_script("tools/plot_metrics.py", [str(tmp_path / "exp" / "lr3e-3"),
                        str(tmp_path / "exp" / "lr1e-3"), "--out", str(out)], timeout=180)
    assert p.returncode == 0, p.stderr
    names = ["loss.png", "valid.png", "lr.png", "throughput.png", "grad_norm.png", "overview.png"]
    assert p.stdout.split() == [str(out / n) for n in names]
    import matplotlib.image as mpimg

    for n in names:
        img = mpimg.imread(out / n)[..., :3]
        assert img.shape[0] > 300 and img.shape[1] > 500, n
        # both runs' curves are drawn: enough pixels in each of the first two colours
        for color in (C0, C1):
            near = (np.abs(img - color).max(axis=-1) < 0.08).sum()
            assert near > 200, (n, color, near)


def test_one_run_goes_to_its_plots_folder(tmp_path):
    write_run(tmp_path / "run", 30, 1e-3)
    p = run_script("tools/plot_metrics.py", [str(tmp_path / "run")], timeout=180)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == str(tmp_path / "run" / "plots" / "loss.png")
    assert len(list((tmp_path / "run" / "plots").glob("*.png"))) == 6


def test_missing_metrics_is_one_line_error(tmp_path):
    p = run_script("tools/plot_metrics.py", [str(tmp_path)], timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip() == (f"error: {tmp_path / 'metrics.jsonl'}: not found "
                                f"(a run folder written by train.py holds metrics.jsonl)")


def test_same_folder_names_are_told_apart():
    from pathlib import Path

    assert plot_metrics.unique_names([Path("/x/a/run"), Path("/x/b/run")]) == ["a/run", "b/run"]
    assert plot_metrics.unique_names([Path("/x/a"), Path("/x/b")]) == ["a", "b"]


def test_ema():
    assert plot_metrics.ema([1.0, 3.0, 3.0], 0.5) == [1.0, 2.0, 2.5]


def test_moe_runs_get_a_load_balance_figure(tmp_path):
    """A run with MoE metrics (moe/layer{i}/max_load, min_load, dropped) gets moe_balance.png with a curve per
    layer; dense runs do not (the other tests count 6 figures)."""
    folder = tmp_path / "moe"
    folder.mkdir()
    rows = [{"kind": "train", "step": s, "loss": 5.0, "moe/layer0/max_load": 1.0 + 1.0 / s,
             "moe/layer0/min_load": 1.0 - 0.5 / s, "moe/layer0/dropped": 0.1 / s,
             "moe/layer1/max_load": 1.5 + 0.5 / s, "moe/layer1/min_load": 0.5 - 0.2 / s,
             "moe/layer1/dropped": 0.05 / s}
            for s in range(1, 30)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = plot_metrics.read_run(folder)
    assert plot_metrics.moe_layers(run) == ["layer0", "layer1"]
    paths = plot_metrics.plot_runs([run], tmp_path / "plots")
    assert tmp_path / "plots" / "moe_balance.png" in paths
    import matplotlib.image as mpimg

    img = mpimg.imread(tmp_path / "plots" / "moe_balance.png")[..., :3]
    for color in (C0, C1):  # a color per layer
        assert (np.abs(img - color).max(axis=-1) < 0.08).sum() > 200, color


def test_evaluation_records_get_an_eval_figure(tmp_path):
    """kind "eval" records (evaluation.tasks: eval/<task>/acc, acc_norm) are read and drawn in eval.png, a colour
    per task."""
    folder = tmp_path / "ev"
    folder.mkdir()
    rows = [{"kind": "train", "step": s, "loss": 5.0} for s in range(1, 31)]
    rows += [{"kind": "eval", "step": s, "eval/mc_a/acc": 0.2 + 0.02 * s, "eval/mc_a/acc_norm": 0.3,
              "eval/mc_b/acc": 0.5, "eval/mc_b/acc_norm": 0.1 + 0.01 * s, "eval_time": 0.1} for s in (10, 20, 30)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = plot_metrics.read_run(folder)
    assert run.eval_tasks() == ["mc_a", "mc_b"]
    xs, ys = run.series("eval/mc_a/acc", "eval")
    assert xs == [10, 20, 30] and ys == pytest.approx([0.4, 0.6, 0.8])
    paths = plot_metrics.plot_runs([run], tmp_path / "plots")
    assert tmp_path / "plots" / "eval.png" in paths
    import matplotlib.image as mpimg

    img = mpimg.imread(tmp_path / "plots" / "eval.png")[..., :3]
    for color in (C0, C1):  # a color per task
        assert (np.abs(img - color).max(axis=-1) < 0.08).sum() > 200, color
