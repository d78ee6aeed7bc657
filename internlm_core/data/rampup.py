"""InternLM's batch-size ramp-up (`data.rampup_batch_size = "start increment every"`, data/batch_sampler.py):
step s takes min(start + (s // every) * increment, micro_num) micro-batch rows per data-parallel rank."""

from __future__ import annotations

from internlm_core.errors import DataError


class Rampup:
    """The number of micro-batch rows of each step, and the step a count of consumed rows falls in."""

    def __init__(self, spec: str, micro_num: int):
        try:
            self.start, self.inc, self.every = (int(x) for x in str(spec).split())
        except ValueError:
            raise DataError(f"data.rampup_batch_size: expected \"start increment every\", got {spec!r}") from None
        if not (1 <= self.start <= micro_num and self.inc >= 1 and self.every >= 1):
            raise DataError(f"data.rampup_batch_size {spec!r}: expected 1 <= start <= micro_num ({micro_num}), "
                            f"increment >= 1, every >= 1")
        self.micro_num = int(micro_num)
        # the steps of the ramp and the rows (per rank) before each; after them every step takes micro_num
        self._before: list[int] = []
        rows, s = 0, 0
        while self.size(s) < self.micro_num:
            self._before.append(rows)
            rows += self.size(s)
            s += 1
        self._ramp_rows = rows

    def size(self, step: int) -> int:
        """Micro-batch rows of step `step` (0-based) on each data-parallel rank."""
        return min(self.start + (step // self.every) * self.inc, self.micro_num)

    def size_after(self, rows_per_rank: int) -> int:
        """Micro-batch rows of the step that starts after `rows_per_rank` rows of one rank."""
        if rows_per_rank >= self._ramp_rows:
            return self.micro_num
        import bisect

        return self.size(bisect.bisect_right(self._before, rows_per_rank) - 1)
