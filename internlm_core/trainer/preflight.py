"""What a run checks before its first step that needs neither processes nor devices, for `train.py --dry-run`:
the training data's files (tokenized data), the evaluation's tokenizer and task files. The run itself reads the
same things the same way (data/loader.py, trainer/evaluation.py), so a dry run fails with the run's own line."""

from __future__ import annotations

from ..config import Config
from ..data.dataset import list_folder
from ..data.eval_tasks import build_requests, read_task
from .evaluation import load_eval_tokenizer


def preflight(cfg: Config) -> list[str]:
    """One line per check passed; raises the ConfigError / DataError a run would raise before its first step."""
    lines = []
    d = cfg.data
    if d.train_folder is not None and d.type != "streaming":
        files, _, names = list_folder(d.train_folder, d.dataset_type_mode, "data.train_folder")
        lines.append(f"data.train_folder: {len(files)} .bin file(s), dataset types {sorted(names.values())}")
    ev = cfg.evaluation
    if ev.tasks:
        tokenizer = load_eval_tokenizer(cfg)
        tasks = [read_task(t["name"], t["path"], f"evaluation.tasks[{i}].path") for i, t in enumerate(ev.tasks)]
        requests = build_requests(tasks, tokenizer, d.seq_len, cfg.model.vocab_size, ev.target_delimiter)
        lines.append(f"evaluation: {len(tasks)} task file(s) read ({', '.join(t.name for t in tasks)}), "
                     f"{len(requests)} requests")
    return lines
