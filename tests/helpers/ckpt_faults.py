"""Runs train.py's main with checkpoint faults injected through the checkpoint's event seam
(internlm_core/checkpoint/events.py): SIGKILL at a named point of a save, as an OOM kill or a node failure would.

    INTERNLM_CORE_CKPT_FAULT="kill_after_commit@10" python tests/helpers/ckpt_faults.py <train.py arguments>

Points (several comma-separated; nothing happens when the variable is unset):
    kill_after_commit@S     every rank, once step S's checkpoint is complete
    kill_before_marker@S    rank 0, with shards, index and meta written and the COMPLETE marker not
    kill_before_metadata@S  every rank, with its shards written and DCP's index not
SIGKILL cannot be caught: nothing of the process's own cleanup runs.
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "INTERNLM_CORE_CKPT_FAULT"
PHASE_OF = {"kill_after_commit": "saved", "kill_before_marker": "before_marker",
            "kill_before_metadata": "shards_written"}


def parse(spec: str) -> set[tuple[str, int]]:
    """{(phase, step)} of a fault spec; ValueError naming an unknown point."""
    out = set()
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, at = item.partition("@")
        if name not in PHASE_OF:
            raise ValueError(f"{ENV}: unknown fault point {name!r}; expected one of {sorted(PHASE_OF)}")
        out.add((PHASE_OF[name], int(at)))
    return out


def install(spec: str) -> None:
    """Subscribe a listener that kills this process at each (phase, step) of `spec`."""
    from internlm_core.checkpoint import events
    wanted = parse(spec)

    def listener(phase: str, step: int, **info) -> None:
        if (phase, step) not in wanted:
            return
        if phase == "saved":
            info["manager"].wait()  # die only once the checkpoint is complete
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    events.subscribe(listener)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import train
    install(os.environ.get(ENV, ""))
    sys.exit(train.main(sys.argv[1:]))
