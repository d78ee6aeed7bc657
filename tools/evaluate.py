"""Score a checkpoint on multiple-choice task files with lm-evaluation-harness (`lm-eval`, its Hugging Face backend),
offline, as a check of the scores `evaluation.tasks` reports during training.

    python tools/evaluate.py --checkpoint RUN/ckpt/200 --tasks tiny_mc=tasks/tiny_mc.jsonl --out results.json
    python tools/evaluate.py --checkpoint hf_folder --tasks a.jsonl b.jsonl --out results.json --batch-size 16
    python tools/evaluate.py --checkpoint RUN/ckpt --out results.json          # the run's own evaluation.tasks

--checkpoint is a Hugging Face folder (config.json) or a checkpoint written by train.py (any layout; a
save_ckpt_folder means its newest complete checkpoint), which is first exported to a temporary Hugging Face folder
with the run's tokenizer (tools/convert2hf.py's export). Each task file is JSON lines of {"context": str,
"choices": [str, ...], "gold": int} (internlm_core/data/eval_tasks.py); lm-eval reads it through a task YAML
written beside it in a temporary folder (`dataset_path: json`, `output_type: multiple_choice`). lm-eval must be
installed (`pip install "lm-eval>=0.4.5"`); nothing is downloaded (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE).

results.json: {"tasks": {name: {"acc", "acc_norm", "loglik", "num_docs", "loglikelihoods": [[per choice] per
document]}}, "checkpoint", "hf_folder", "lm_eval"}; acc, acc_norm and loglik are defined as in training
(eval/<name>/acc, acc_norm, loglik in metrics.jsonl), the log-likelihoods are those of lm-eval's samples.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


from internlm_core.errors import ConfigError, InternLMCoreError  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Score a checkpoint on multiple-choice task files with lm-eval (offline).")
    p.add_argument("--checkpoint", required=True,
                   help="a Hugging Face folder, or a checkpoint of train.py (or its save_ckpt_folder: the newest)")
    p.add_argument("--tasks", nargs="*", default=None, metavar="[NAME=]PATH",
                   help="task files (.jsonl of context/choices/gold); NAME defaults to the file's name. Default: "
                        "the checkpoint's evaluation.tasks")
    p.add_argument("--out", required=True, help="where to write results.json")
    p.add_argument("--batch-size", type=int, default=8, help="lm-eval's batch size (default 8)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="dtype the model is exported and run in (default float32)")
    p.add_argument("--device", default="cpu", help="torch device lm-eval runs the model on (default cpu)")
    p.add_argument("--max-length", type=int, default=None,
                   help="tokens of context + continuation kept (default: the model's max_position_embeddings, "
                        "the run's data.seq_len)")
    p.add_argument("--target-delimiter", default=" ", help="between context and choice (default ' ')")
    p.add_argument("--no-bos", action="store_true",
                   help="do not start contexts with BOS (training's evaluation always does when the tokenizer has one)")
    return p.parse_args(argv)


def task_files(specs: list[str]) -> dict[str, str]:
    """{name: absolute path} from NAME=PATH or PATH arguments."""
    out: dict[str, str] = {}
    for spec in specs:
        name, _, path = spec.rpartition("=")
        name = name or Path(path).stem
        if not Path(path).is_file():
            raise ConfigError(f"--tasks {spec}: no such file (expected a .jsonl of context/choices/gold lines)")
        if name in out:
            raise ConfigError(f"--tasks: the name {name!r} is given twice")
        out[name] = str(Path(path).resolve())
    return out


def write_task_yaml(folder: Path, name: str, path: str, target_delimiter: str) -> None:
    """lm-eval's task for one file: the documents' own fields as text, choices and gold (no templates)."""
    import yaml

    task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": path}},
            "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "context",
            "doc_to_choice": "choices", "doc_to_target": "gold", "target_delimiter": target_delimiter,
            "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True}
                            for m in ("acc", "acc_norm")],
            "metadata": {"version": 1}}
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(task, sort_keys=False))


def is_hf_folder(checkpoint: str) -> bool:
    """A Hugging Face folder (config.json), not a checkpoint of train.py."""
    return (Path(checkpoint) / "config.json").is_file()


def hf_folder(checkpoint: str, dtype: str, tmp: Path) -> str:
    """The Hugging Face folder itself, or an export of the checkpoint into `tmp` (with the run's tokenizer)."""
    if is_hf_folder(checkpoint):
        return checkpoint
    from internlm_core.checkpoint.hf import export_checkpoint

    out = tmp / "hf"
    print(f"exporting {checkpoint} to a Hugging Face folder ({dtype})", flush=True)
    export_checkpoint(checkpoint, out, dtype=dtype, progress=lambda msg: print(f"  {msg}", flush=True))
    return str(out)


def run_tasks(checkpoint: str) -> list[str]:
    """NAME=PATH of the evaluation.tasks recorded in a checkpoint's config."""
    if is_hf_folder(checkpoint):
        raise ConfigError("--tasks: none given (a Hugging Face folder records no evaluation.tasks)")
    from internlm_core.checkpoint.catalog import checkpoint_config, local_checkpoint

    with local_checkpoint(checkpoint, False) as (folder, _):
        tasks = checkpoint_config(folder).evaluation.tasks
    if not tasks:
        raise ConfigError(f"--tasks: none given, and the config of {checkpoint} names no evaluation.tasks")
    return [f"{t['name']}={t['path']}" for t in tasks]


def summarize(results: dict, names: list[str]) -> dict:
    """Each task's metrics and per-document log-likelihoods from lm-eval's results and samples."""
    out = {}
    for name in names:
        samples = sorted(results["samples"][name], key=lambda s: s["doc_id"])
        lls = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
        golds = [int(s["doc"]["gold"]) for s in samples]
        r = results["results"][name]
        out[name] = {"acc": r["acc,none"], "acc_norm": r["acc_norm,none"],
                     "loglik": sum(ll[g] for ll, g in zip(lls, golds)) / len(lls), "num_docs": len(lls),
                     "loglikelihoods": lls}
    return out


def run_lm_eval(hf: str, tasks: dict[str, str], args: argparse.Namespace, tmp: Path) -> dict:
    """lm-eval's simple_evaluate on the local tasks (no built-in task is indexed), with its progress bars."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise InternLMCoreError("tools/evaluate.py needs lm-eval: pip install \"lm-eval>=0.4.5\"") from None
    folder = tmp / "tasks"
    folder.mkdir()
    for name, path in tasks.items():
        write_task_yaml(folder, name, path, args.target_delimiter)
    model_args = {"pretrained": hf, "dtype": args.dtype, "add_bos_token": not args.no_bos}
    if args.max_length is not None:
        model_args["max_length"] = args.max_length
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    return lm_eval.simple_evaluate(model="hf", model_args=model_args, tasks=list(tasks), task_manager=manager,
                                   batch_size=args.batch_size, log_samples=True, device=args.device)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.perf_counter()
    tasks = task_files(args.tasks if args.tasks is not None else run_tasks(args.checkpoint))
    with tempfile.TemporaryDirectory(prefix="evaluate-") as tmp:
        hf = hf_folder(args.checkpoint, args.dtype, Path(tmp))
        results = run_lm_eval(hf, tasks, args, Path(tmp))
        import lm_eval

        report = {"checkpoint": args.checkpoint, "hf_folder": hf if hf == args.checkpoint else None,
                  "lm_eval": getattr(lm_eval, "__version__", "?"), "tasks": summarize(results, list(tasks))}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for name, r in report["tasks"].items():
        print(f"{name}: acc={r['acc']:.4f} acc_norm={r['acc_norm']:.4f} loglik={r['loglik']:.4f} "
              f"({r['num_docs']} documents)")
    print(f"wrote {args.out} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    from internlm_core.utils.cli import run_main

    run_main(main)
