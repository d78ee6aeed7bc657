"""Test-only fault injection: kill this process with SIGKILL at a named point of a checkpoint's life.

    INTERNLM_CORE_CKPT_FAULT="kill_after_commit@10"            # after step 10's checkpoint is complete
    INTERNLM_CORE_CKPT_FAULT="kill_before_marker@10"           # shards, index and meta written, marker not
    INTERNLM_CORE_CKPT_FAULT="kill_before_metadata@10"         # every rank's shards written, DCP's index not

Several points can be given, comma-separated. Nothing happens when the variable is unset. SIGKILL cannot be
caught: the process ends as it would on an OOM kill or a node failure.
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "INTERNLM_CORE_CKPT_FAULT"
POINTS = ("kill_after_commit", "kill_before_marker", "kill_before_metadata")


def requested(point: str, step: int) -> bool:
    spec = os.environ.get(ENV, "")
    if not spec:
        return False
    for item in spec.split(","):
        name, _, at = item.strip().partition("@")
        if name == point and at.strip() == str(step):
            return True
    return False


def maybe_kill(point: str, step: int) -> None:
    if requested(point, step):
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
