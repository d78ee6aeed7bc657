"""Mixing dataset types by weight (`data.dataset_weights`), as Megatron's BlendedDataset does.

Each type is its own stream of packed rows (its documents shuffled per epoch, see index.py). The weights become
integers ``q_t``: the shares in the smallest period of at most `RESOLUTION` rows in which every share is a whole
number of rows (0.8/0.2: 4 and 1 of 5), else the shares rounded to 1/RESOLUTION. One period of ``D = sum(q_t)``
global rows gives type t exactly ``q_t`` rows, interleaved as evenly as
possible: the k-th row of type t sits at time ``(k + 1/2) / q_t`` of the period, and rows are taken in time order.
So over any window of rows each type's share of tokens is its weight up to about one row per type, the
assignment of global row g is a closed form (g // D periods, then the schedule), and it does not depend on the
number of data-parallel ranks: resuming anywhere, with any layout, is exact.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from internlm_core.errors import DataError

RESOLUTION = 1 << 16


class Mixture:
    """Global row g → (stream index, row of that stream); `rows_before(c)` → rows of each stream among [0, c)."""

    def __init__(self, weights: Mapping, type_names: Mapping[int, str], where: str):
        names = {str(n): int(t) for t, n in type_names.items()}
        if not isinstance(weights, Mapping) or not weights:
            raise DataError(f"data.dataset_weights: expected a dict {{dataset type: weight}}, got {weights!r}")
        listed = ", ".join(sorted(names))
        unknown = [str(k) for k in weights if str(k) not in names]
        if unknown:
            raise DataError(f"data.dataset_weights: unknown dataset type {unknown[0]!r}; the types of {where} are "
                            f"{listed}")
        missing = [n for n in sorted(names) if n not in {str(k) for k in weights}]
        if missing:
            raise DataError(f"data.dataset_weights: no weight for dataset type {missing[0]!r} of {where} (its types: "
                            f"{listed}); give every type a weight > 0 (leave a type out by moving its files)")
        w = {}
        for k, v in weights.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise DataError(f"data.dataset_weights[{str(k)!r}]: expected a weight > 0, got {v!r}")
            w[names[str(k)]] = float(v)
        self.types = sorted(w)  # stream i holds type self.types[i]
        total = sum(w.values())
        self.weights = [w[t] / total for t in self.types]
        ws = np.asarray(self.weights)
        scaled = np.arange(1, RESOLUTION + 1)[:, None] * ws[None, :]  # the smallest exact period, if any (0.8/0.2: 5)
        exact = np.nonzero(np.abs(scaled - np.round(scaled)).max(axis=1) < 1e-6)[0]
        D = int(exact[0]) + 1 if len(exact) else RESOLUTION
        q = [int(round(x * D)) for x in self.weights]
        if min(q) < 1:
            small = type_names[self.types[q.index(min(q))]]
            raise DataError(f"data.dataset_weights[{small!r}]: weight {w[self.types[q.index(min(q))]]} is below "
                            f"1/{RESOLUTION} of the total; raise it or remove the type's files")
        g = math.gcd(*q)
        self.q = np.asarray([x // g for x in q], dtype=np.int64)  # tokens of type t: q_t / D of the rows
        self.period = int(self.q.sum())
        keys = np.concatenate([(np.arange(n) + 0.5) / n for n in self.q.tolist()])
        owner = np.concatenate([np.full(n, i) for i, n in enumerate(self.q.tolist())])
        kth = np.concatenate([np.arange(n) for n in self.q.tolist()])
        order = np.lexsort((owner, keys))
        self.sched_stream = owner[order].astype(np.int64)
        self.sched_k = kth[order].astype(np.int64)

    def locate(self, g: int) -> tuple[int, int]:
        p, i = divmod(int(g), self.period)
        s = int(self.sched_stream[i])
        return s, p * int(self.q[s]) + int(self.sched_k[i])

    def rows_before(self, c: int) -> np.ndarray:
        """Rows of each stream among the global rows [0, c)."""
        p, i = divmod(int(c), self.period)
        return p * self.q + np.bincount(self.sched_stream[:i], minlength=len(self.q))
