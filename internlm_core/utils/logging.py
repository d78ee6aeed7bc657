"""The one logger factory: `get_logger(__name__)` everywhere, `setup_logging` once per process."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from .redact import SecretFilter, register_env_secrets

_ROOT = "internlm_core"
_FORMAT = "%(asctime)s %(levelname)s [rank{rank}] %(name)s: %(message)s"


def get_logger(name: str) -> logging.Logger:
    """A logger under the package root, so that one `setup_logging` call configures all of them."""
    if not name.startswith(_ROOT):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)


def setup_logging(rank: int = 0, run_dir: str | Path | None = None, console_all_ranks: bool = False,
                  level: int = logging.INFO) -> None:
    """Console output from rank 0 (or every rank), and `rank{N}.log` in the run folder for every rank; every handler
    redacts secrets (utils/redact.py: the environment's are registered here, a config's when it is loaded)."""
    register_env_secrets()
    root = logging.getLogger(_ROOT)
    root.setLevel(level)
    root.propagate = False
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    fmt = logging.Formatter(_FORMAT.format(rank=rank), datefmt="%Y-%m-%d %H:%M:%S")
    if rank == 0 or console_all_ranks:
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(fmt)
        root.addHandler(console)
    else:  # other ranks still report warnings and errors on the console
        console = logging.StreamHandler(sys.stderr)
        console.setLevel(logging.WARNING)
        console.setFormatter(fmt)
        root.addHandler(console)
    if run_dir is not None:
        os.makedirs(run_dir, exist_ok=True)
        fh = logging.FileHandler(Path(run_dir) / f"rank{rank}.log")
        fh.setFormatter(fmt)
        root.addHandler(fh)
    for h in root.handlers:  # on the handlers: a logger's own filters do not see its children's records
        h.addFilter(SecretFilter())
