"""Which checkpoints are kept and where a snapshot goes: `keep_last_k` for regular checkpoints, the two alternating
snapshot slots of `oss_snapshot_freq`. (Replaced folders are set aside by the storage and emptied after a save.)"""

from __future__ import annotations

from typing import Optional

from ..utils.logging import get_logger
from .catalog import find_complete_checkpoints
from .collectives import Collectives
from .storage import SNAPSHOT_SLOTS, Storage

logger = get_logger(__name__)


def keep_last_k(storage: Storage, k: int, just_written: str) -> None:
    """Delete the oldest complete regular checkpoints beyond `k` (0: keep all); never the newest, never the one just
    written, never a snapshot slot, never an incomplete folder. A failure is a warning, not an error."""
    if k <= 0:
        return
    try:
        done = [r for r in find_complete_checkpoints(storage) if r.name not in SNAPSHOT_SLOTS]
        done.sort(key=lambda r: r.step, reverse=True)
        keep = {r.name for r in done[:k]} | {just_written}
        for r in done:
            if r.name not in keep:
                storage.delete(r.name)
                logger.info("keep_last_k=%d: removed checkpoint %s", k, r.url)
    except Exception as e:
        logger.warning("keep_last_k: cleaning up old checkpoints failed: %s", e)


class SnapshotSlots:
    """The slot the next snapshot goes into: the one not holding the newest complete snapshot. Read from the
    markers at first, then the other slot after each complete snapshot (a failed one is retried in the same slot,
    never over the good one)."""

    def __init__(self, storage: Storage, coll: Collectives):
        self.storage, self.coll = storage, coll
        self._next: Optional[int] = None

    def next(self) -> str:
        """The slot to write (a collective the first time: rank 0 reads the markers)."""
        if self._next is None:
            slot = 0
            if self.coll.rank == 0:
                try:
                    steps = []
                    for s in SNAPSHOT_SLOTS:
                        m = self.storage.read_marker(s)
                        steps.append(m["step"] if m else -1)
                    slot = 0 if steps[0] <= steps[1] else 1
                except Exception as e:
                    logger.warning("snapshot slots: cannot read their markers (%s); writing slot 0", e)
            self._next = int(self.coll.broadcast(slot))
        return SNAPSHOT_SLOTS[self._next]

    def completed(self, name: str) -> None:
        """Snapshot slot `name` now holds the newest complete snapshot."""
        self._next = 1 - SNAPSHOT_SLOTS.index(name)
