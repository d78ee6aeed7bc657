"""PNG figures of training runs from their `metrics.jsonl`: several runs overlaid, one colour per run.

    python tools/plot_metrics.py RUN_DIR                         # figures in RUN_DIR/plots/
    python tools/plot_metrics.py RUN_A RUN_B --out compare/      # two runs overlaid

Writes loss.png (training loss, with an EMA above 200 steps, and validation loss), valid.png (validation ACC and PPL
per dataset), lr.png, throughput.png (tokens per GPU per second, and MFU when known), grad_norm.png, and
overview.png with all of them, and eval.png (evaluation.tasks: acc and acc_norm per task) when the run has
evaluation records; prints the path of each. A resumed run (steps written twice) keeps the
latest record of each step; a truncated last line (a crash) is skipped. A `restart` record (an elastic restart, a
requeue) or a `rewind` record (a loss spike rewound) at step S drops the earlier records of steps after S: those
steps were trained again (or skipped) after it; the loss plot marks each with a vertical line, as it does a `heal`
record (a replica group that took a live peer's state and continues from its step).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path


from internlm_core.errors import DataError  # noqa: E402


@dataclass
class Run:
    """The records of one run: train and valid, each a list of dicts sorted by step (one per step)."""

    name: str
    path: Path
    train: list = field(default_factory=list)
    valid: list = field(default_factory=list)
    eval: list = field(default_factory=list)  # evaluation.tasks' records (eval/<task>/acc, acc_norm, loglik)
    events: list = field(default_factory=list)  # restart and rewind records, in file order
    skipped_lines: int = 0

    def series(self, key: str, kind: str = "train") -> tuple[list, list]:
        """(steps, values) of `key`, finite numbers only."""
        xs, ys = [], []
        for r in {"train": self.train, "valid": self.valid, "eval": self.eval}[kind]:
            v = r.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                xs.append(r["step"])
                ys.append(float(v))
        return xs, ys

    def eval_tasks(self) -> list[str]:
        return sorted({k.split("/")[1] for r in self.eval for k in r if k.startswith("eval/") and k.count("/") == 2})

    def valid_datasets(self) -> list[str]:
        names = set()
        for r in self.valid:
            for k in r:
                parts = k.split("/")
                if len(parts) == 3 and parts[0] == "valid" and parts[2] in ("loss", "acc", "ppl"):
                    names.add(parts[1])
        return sorted(names)


def read_run(path: str | os.PathLike, name: str | None = None) -> Run:
    """Read RUN_DIR/metrics.jsonl (or a metrics.jsonl file given directly)."""
    p = Path(path)
    f = p / "metrics.jsonl" if p.is_dir() else p
    if not f.is_file():
        raise DataError(f"{f}: not found (a run folder written by train.py holds metrics.jsonl)")
    run = Run(name or (p.name if p.is_dir() else p.parent.name), p)
    by_kind: dict[str, dict[int, dict]] = {"train": {}, "valid": {}, "eval": {}}
    with open(f, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
                step = int(rec["step"])
            except (ValueError, KeyError, TypeError):
                run.skipped_lines += 1
                continue
            kind = rec.get("kind", "train")
            if kind in by_kind:
                by_kind[kind][step] = rec  # a resumed run rewrites steps: the latest record wins
            elif kind in ("restart", "rewind"):  # training went back to `step`: what came after it is void
                run.events.append(rec)
                for records in by_kind.values():
                    for s in [s for s in records if s > step]:
                        del records[s]
            elif kind == "heal":  # a replica group took a live peer's state at `step` (no records of its own before)
                run.events.append(rec)
    run.train = [by_kind["train"][s] for s in sorted(by_kind["train"])]
    run.valid = [by_kind["valid"][s] for s in sorted(by_kind["valid"])]
    run.eval = [by_kind["eval"][s] for s in sorted(by_kind["eval"])]
    if not run.train and not run.valid and not run.eval:
        raise DataError(f"{f}: no metrics records (has the run finished a step yet?)")
    return run


def unique_names(paths: list[Path]) -> list[str]:
    """Folder names, lengthened with their parents where two runs would share a name."""
    names = [p.name for p in paths]
    depth = 1
    while len(set(names)) < len(names) and depth < 6:
        depth += 1
        names = ["/".join(p.resolve().parts[-depth:]) for p in paths]
    return names


SMOOTH_ABOVE = 200  # more training steps than this: the raw loss is drawn faint, its EMA on top
SMOOTHING = 0.95


def ema(values: list[float], alpha: float) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else alpha * acc + (1 - alpha) * v
        out.append(acc)
    return out


# ---- figures ----------------------------------------------------------------------------------------------

def _colors(n: int):
    import matplotlib.pyplot as plt

    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return [cycle[i % len(cycle)] for i in range(n)]


def _dataset_colors(n: int):
    """One run: validation datasets get the colours after the first (the training curve's)."""
    return _colors(n + 1)[1:]


def plot_loss(ax, runs: list[Run], colors) -> bool:
    drawn = False
    for run, c in zip(runs, colors):
        xs, ys = run.series("loss")
        if xs:
            smooth = len(ys) > SMOOTH_ABOVE
            ax.plot(xs, ys, color=c, alpha=0.3 if smooth else 1.0, lw=0.8 if smooth else 1.5,
                    label=None if smooth else f"{run.name} train")
            if smooth:
                ax.plot(xs, ema(ys, SMOOTHING), color=c, lw=1.5, label=f"{run.name} train (EMA {SMOOTHING})")
            drawn = True
        datasets = run.valid_datasets()
        ds_colors = _dataset_colors(len(datasets)) if len(runs) == 1 else [c] * len(datasets)
        for j, ds in enumerate(datasets):
            vx, vy = run.series(f"valid/{ds}/loss", "valid")
            if vx:
                ax.plot(vx, vy, color=ds_colors[j], ls="--", marker="os^vD"[j % 5], ms=5, lw=1.2,
                        label=f"{run.name} valid {ds}")
                drawn = True
    for run, c in zip(runs, colors):
        for i, ev in enumerate(run.events):
            first = i == 0 or all(e["kind"] != ev["kind"] for e in run.events[:i])
            ax.axvline(ev["step"], color=c, ls=":" if ev["kind"] == "restart" else "-.", lw=1, alpha=0.7,
                       label=f"{run.name} {ev['kind']}" if first else None)
            drawn = True
    ax.set_title("loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    return drawn


def plot_valid(ax_acc, ax_ppl, runs: list[Run], colors) -> bool:
    drawn = False
    one = len(runs) == 1  # one run: a colour per dataset; several: a colour per run, a marker per dataset
    for run, c in zip(runs, colors):
        datasets = run.valid_datasets()
        ds_colors = _dataset_colors(len(datasets)) if one else [c] * len(datasets)
        for j, ds in enumerate(datasets):
            for ax, key in ((ax_acc, "acc"), (ax_ppl, "ppl")):
                vx, vy = run.series(f"valid/{ds}/{key}", "valid")
                if vx:
                    ax.plot(vx, vy, color=ds_colors[j], marker="os^vD"[j % 5], ms=5, lw=1.2,
                            label=ds if one else f"{run.name} {ds}")
                    drawn = True
    ax_acc.set_title("validation accuracy")
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("next-token accuracy")
    ax_ppl.set_title("validation perplexity")
    ax_ppl.set_xlabel("step")
    ax_ppl.set_ylabel("perplexity (exp loss)")
    ax_ppl.set_yscale("log")
    return drawn


def plot_eval(ax_acc, ax_norm, runs: list[Run], colors) -> bool:
    """evaluation.tasks: acc and acc_norm of each task over the steps (a colour per task, or per run)."""
    drawn = False
    one = len(runs) == 1
    for run, c in zip(runs, colors):
        tasks = run.eval_tasks()
        task_colors = _colors(len(tasks)) if one else [c] * len(tasks)
        for j, task in enumerate(tasks):
            for ax, key in ((ax_acc, "acc"), (ax_norm, "acc_norm")):
                xs, ys = run.series(f"eval/{task}/{key}", "eval")
                if xs:
                    ax.plot(xs, ys, color=task_colors[j], marker="os^vD"[j % 5], ms=5, lw=1.2,
                            label=task if one else f"{run.name} {task}")
                    drawn = True
    for ax, title in ((ax_acc, "evaluation accuracy (acc)"), (ax_norm, "evaluation accuracy, length-normalized")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel("fraction of documents right")
        ax.set_ylim(0, 1)
    return drawn


def plot_simple(ax, runs: list[Run], colors, key: str, title: str, ylabel: str, log: bool = False) -> bool:
    drawn = False
    for run, c in zip(runs, colors):
        xs, ys = run.series(key)
        if xs:
            ax.plot(xs, ys, color=c, lw=1.2, label=run.name)
            drawn = True
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if log and drawn:
        ax.set_yscale("log")
    return drawn


def moe_layers(run: Run) -> list[str]:
    """The MoE layers a run recorded (moe/layer{i}/max_load), in layer order."""
    found = {k.split("/")[1] for r in run.train for k in r if k.startswith("moe/layer") and k.endswith("/max_load")}
    return sorted(found, key=lambda name: int(name[len("layer"):]) if name[len("layer"):].isdigit() else 0)


def plot_moe_balance(ax_load, ax_drop, runs: list[Run]) -> bool:
    """Per MoE layer: the busiest expert's load over the mean (solid) and the idlest's (dashed), 1.0 balanced; and
    the fraction of routed tokens dropped over capacity. One color per layer, one line style per run."""
    drawn = False
    styles = ("-", "-.", ":", (0, (5, 1)))
    for i, run in enumerate(runs):
        layers = moe_layers(run)
        colors = _colors(len(layers))
        for layer, c in zip(layers, colors):
            label = layer if len(runs) == 1 else f"{run.name} {layer}"
            for key, ls, lab in (("max_load", styles[i % len(styles)], f"{label} max"), ("min_load", "--", None)):
                xs, ys = run.series(f"moe/{layer}/{key}")
                if xs:
                    ax_load.plot(xs, ys, color=c, lw=1.1, ls=ls, label=lab)
                    drawn = True
            xs, ys = run.series(f"moe/{layer}/dropped")
            if xs:
                ax_drop.plot(xs, ys, color=c, lw=1.1, ls=styles[i % len(styles)], label=label)
    ax_load.axhline(1.0, color="0.5", lw=0.8)
    ax_load.set_title("expert load (max solid, min dashed) over the mean")
    ax_drop.set_title("tokens dropped over capacity")
    for ax, ylabel in ((ax_load, "tokens per expert / mean"), (ax_drop, "fraction of routed tokens")):
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
    return drawn


def _finish(ax, drawn: bool) -> None:
    if drawn:
        ax.legend(fontsize="small", framealpha=0.6)
        ax.grid(True, alpha=0.3)
    else:
        ax.text(0.5, 0.5, "no data in metrics.jsonl", ha="center", va="center", transform=ax.transAxes)


def plot_runs(runs: list[Run], out_dir: str | os.PathLike) -> list[Path]:
    """Write the figures; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    colors = _colors(len(runs))
    title = ", ".join(r.name for r in runs)
    paths = []

    def save(fig, name: str) -> None:
        fig.suptitle(title, fontsize="medium")
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)

    def single(name: str, draw) -> None:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _finish(ax, draw(ax))
        save(fig, name)

    single("loss.png", lambda ax: plot_loss(ax, runs, colors))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    drawn = plot_valid(a1, a2, runs, colors)
    _finish(a1, drawn)
    _finish(a2, drawn)
    save(fig, "valid.png")
    single("lr.png", lambda ax: plot_simple(ax, runs, colors, "lr", "learning rate", "learning rate"))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    _finish(a1, plot_simple(a1, runs, colors, "tgs", "throughput", "tokens per GPU (device) per second"))
    _finish(a2, plot_simple(a2, runs, colors, "mfu", "model FLOPs utilization", "MFU (fraction of peak)"))
    save(fig, "throughput.png")
    single("grad_norm.png", lambda ax: plot_simple(ax, runs, colors, "grad_norm", "gradient norm",
                                                   "global gradient L2 norm (before clipping)", log=True))

    if any(moe_layers(r) for r in runs):  # mixture-of-experts runs: how evenly the experts are loaded
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
        drawn = plot_moe_balance(a1, a2, runs)
        _finish(a1, drawn)
        _finish(a2, drawn)
        save(fig, "moe_balance.png")

    if any(r.eval for r in runs):  # evaluation.tasks: multiple-choice scores
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
        drawn = plot_eval(a1, a2, runs, colors)
        _finish(a1, drawn)
        _finish(a2, drawn)
        save(fig, "eval.png")

    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    _finish(axes[0, 0], plot_loss(axes[0, 0], runs, colors))
    drawn = plot_valid(axes[0, 1], axes[0, 2], runs, colors)
    _finish(axes[0, 1], drawn)
    _finish(axes[0, 2], drawn)
    _finish(axes[1, 0], plot_simple(axes[1, 0], runs, colors, "lr", "learning rate", "learning rate"))
    _finish(axes[1, 1], plot_simple(axes[1, 1], runs, colors, "tgs", "throughput", "tokens per GPU per second"))
    _finish(axes[1, 2], plot_simple(axes[1, 2], runs, colors, "grad_norm", "gradient norm", "gradient L2 norm",
                                    log=True))
    save(fig, "overview.png")
    return paths


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="PNG figures of training runs (metrics.jsonl), several runs overlaid.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folder(s) holding metrics.jsonl")
    p.add_argument("--out", default=None,
                   help="folder for the PNGs (default: RUN_DIR/plots for one run, ./plots for several)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    paths = [Path(r) for r in args.runs]
    runs = [read_run(p, n) for p, n in zip(paths, unique_names(paths))]
    for r in runs:
        if r.skipped_lines:
            print(f"{r.name}: skipped {r.skipped_lines} unreadable line(s) of metrics.jsonl", file=sys.stderr)
    out = args.out or (paths[0] / "plots" if len(paths) == 1 and paths[0].is_dir() else Path("plots"))
    for f in plot_runs(runs, out):
        print(f)
    return 0


if __name__ == "__main__":
    from internlm_core.utils.cli import run_main

    run_main(main)
