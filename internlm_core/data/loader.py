"""Train and validation loaders: the interface the trainer consumes.

Training order (deterministic from `data.seed`): the documents form one or more streams — one holding every
document, or with `data.dataset_weights` one per dataset type — and epoch e of a stream shuffles its documents
(index.py) and packs them into ``tokens // packed_length`` rows (the epoch's last partial row is dropped). All
rows form one infinite sequence of global rows: without weights, the stream's rows epoch after epoch; with
weights, the streams' rows interleaved by the mixture's schedule (mixture.py). Optimizer step s on data-parallel
rank r takes the `micro_num` global rows starting at ``consumed + r * micro_num`` where ``consumed`` counts the
rows of all ranks before the step. The loader's state is that count, so resuming is exact (no replay, no repeats,
no gaps) and works with another `dp_size`. The dataset is never too small: a step may take rows from two epochs.

`consumed_tokens_per_type()` gives the tokens of each dataset type in all rows consumed so far by all ranks
(exact: from the schedule, or from the per-row type counts of the epoch index).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, Iterable, Iterator, List, Optional

import numpy as np

from internlm_core.errors import DataError
from internlm_core.utils.logging import get_logger

from .dataset import DocTable, build_valid_tables, data_seed, dummy_table, list_folder, open_files
from .index import EpochSource, Stream, build_epoch_in_memory, default_cache_root, rows_of, scan_table
from .mixture import Mixture
from .rampup import Rampup
from .streaming import build_streaming_loader
from .batches import Batch, Prefetch, collate, row_shape
from .packing import Packer, RowShape

logger = get_logger(__name__)


class TrainLoader(Prefetch):
    """Infinite iterator of training batches with an exact `state_dict` (see module docstring)."""

    STATE_VERSION = 2

    def __init__(self, streams: List[EpochSource], mixture: Optional[Mixture], shape: RowShape, *, micro_num: int,
                 dp_rank: int, dp_size: int, seed: int, vocab_size: Optional[int], type_names: Dict[int, str],
                 prefetch: int = 0, rampup: Optional[Rampup] = None):
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"data loader: dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
        if micro_num < 1:
            raise DataError(f"data.micro_num: expected >= 1, got {micro_num}")
        self.streams, self.mixture, self.shape = streams, mixture, shape
        self.table: DocTable = streams[0].stream.table
        self.packers = [Packer(s.stream.table, shape, vocab_size) for s in streams]
        self.micro_num, self.dp_rank, self.dp_size = int(micro_num), int(dp_rank), int(dp_size)
        self.seed = int(seed)
        self.packed_length = shape.packed_length
        self._type_names = dict(type_names)
        self.consumed = 0  # rows consumed by all ranks together
        self.prefetch = int(prefetch)
        self.rampup = rampup  # InternLM's rampup_batch_size: fewer rows per step at first
        self._lock = threading.Lock()
        first = streams[0].stream
        self._count_base = (0, np.zeros(len(first.types), dtype=np.int64))

    @property
    def type_names(self) -> Dict[int, str]:
        return dict(self._type_names)

    @property
    def rows_per_epoch(self) -> int:
        """Rows of one epoch of the (first) stream."""
        return self.streams[0].stream.rows_per_epoch

    def epoch_of(self, consumed: Optional[int] = None) -> int:
        c = self.consumed if consumed is None else consumed
        if self.mixture is None:
            return c // self.rows_per_epoch
        rows = self.mixture.rows_before(c)
        return int(max(r // s.stream.rows_per_epoch for r, s in zip(rows.tolist(), self.streams)))

    def global_row(self, g: int) -> dict:
        i, r = self.mixture.locate(g) if self.mixture is not None else (0, g)
        src = self.streams[i]
        e, k = divmod(r, src.stream.rows_per_epoch)
        return self.packers[i].row(src.epoch(e), k)

    def micro_num_at(self, consumed: int) -> int:
        """Rows per rank of the step that starts after `consumed` rows (micro_num, or less while ramping up)."""
        return self.micro_num if self.rampup is None else self.rampup.size_after(consumed // self.dp_size)

    def rows_at(self, consumed: int) -> int:
        return self.micro_num_at(consumed) * self.dp_size

    def batch_at(self, consumed: int) -> Batch:
        """This rank's batch of the step that starts after `consumed` rows."""
        n = self.micro_num_at(consumed)
        first = consumed + self.dp_rank * n
        rows = [self.global_row(first + m) for m in range(n)]
        return collate(rows, self._type_names)

    # -- tokens per type
    def consumed_tokens_per_type(self) -> Dict[str, int]:
        """{type name: tokens of that type in the rows consumed so far by all data-parallel ranks}."""
        c, P = self.consumed, self.packed_length
        if self.mixture is not None:
            rows = self.mixture.rows_before(c)
            return {self._type_names[t]: int(n) * P for t, n in zip(self.mixture.types, rows.tolist())}
        stream = self.streams[0].stream
        counts = self._stream_counts(c) if stream.with_types else [c * P]
        return {self._type_names[t]: int(n) for t, n in zip(stream.types, counts)}

    def _stream_counts(self, c: int) -> np.ndarray:
        src = self.streams[0]
        R = src.stream.rows_per_epoch
        g, counts = self._count_base
        if c < g:
            g, counts = 0, np.zeros_like(counts)
        counts = counts.copy()
        while g < c:
            e, k = divmod(g, R)
            k_end = min(R, k + (c - g))
            ep = src.epoch(e)
            counts += ep.type_counts(k_end) - ep.type_counts(k)
            g += k_end - k
        self._count_base = (c, counts)
        return counts

    # -- state
    def state_dict(self) -> Dict[str, Any]:
        sd = {"version": self.STATE_VERSION, "rows_consumed": int(self.consumed), "epoch": int(self.epoch_of()),
              "seed": self.seed, "packed_length": self.packed_length, "rows_per_epoch": int(self.rows_per_epoch),
              "num_docs": int(self.table.num_docs), "num_tokens": int(self.table.num_tokens),
              "dp_size": self.dp_size, "micro_num": self.micro_num}
        if self.mixture is not None:
            sd["dataset_weights"] = {self._type_names[t]: float(w) for t, w in zip(self.mixture.types,
                                                                                    self.mixture.weights)}
        elif self.streams[0].stream.with_types:
            sd["tokens_per_type"] = [int(x) for x in self._stream_counts(self.consumed)]
        return sd

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Resume after `sd["rows_consumed"]` rows (also while an iterator is open: it continues from there)."""
        if "rows_consumed" not in sd:
            raise DataError(f"data loader state: missing 'rows_consumed' (keys: {sorted(sd)})")
        mine = self.state_dict()
        changed = [k for k in ("seed", "packed_length", "num_docs", "num_tokens")
                   if k in sd and int(sd[k]) != mine[k]]
        if sd.get("dataset_weights", mine.get("dataset_weights")) != mine.get("dataset_weights"):
            changed.append("dataset_weights")
        if changed:
            logger.warning("data loader state: %s changed since the checkpoint (%s); resuming after %d rows of the "
                           "new order", ", ".join(changed),
                           ", ".join(f"{k}: {sd.get(k)} -> {mine.get(k)}" for k in changed), int(sd["rows_consumed"]))
        if "dp_size" in sd and int(sd["dp_size"]) * int(sd.get("micro_num", self.micro_num)) != self.rows_per_step:
            logger.info("data loader state: rows per step changed from %d to %d; continuing without gaps",
                        int(sd["dp_size"]) * int(sd.get("micro_num", self.micro_num)), self.rows_per_step)
        self.consumed = int(sd["rows_consumed"])
        base = sd.get("tokens_per_type")
        n_types = len(self.streams[0].stream.types)
        if base is not None and len(base) == n_types and not changed:
            self._count_base = (self.consumed, np.asarray(base, dtype=np.int64))


class ValidLoader:
    """A finite, re-iterable loader over one validation table, in order, split over data-parallel ranks.

    Rows are the table's stream cut every `packed_length` tokens, the last one padded. Global batch g holds rows
    ``[g * micro_num, (g + 1) * micro_num)`` and goes to rank ``g % dp_size``; every rank gets the same number of
    batches (rows past the end are all padding, labels all -100), so that collective ops stay in step.
    """

    def __init__(self, name: str, table: DocTable, shape: RowShape, *, micro_num: int, dp_rank: int, dp_size: int,
                 vocab_size: Optional[int]):
        self.name, self.table = name, table
        self.packer = Packer(table, shape, vocab_size)
        stream = Stream(table, list(range(len(table.sources))), (0,), shape.packed_length, with_types=False,
                        keep_tail=True, shuffle=False)
        self.epoch = build_epoch_in_memory(stream, 0)
        self.micro_num, self.dp_rank, self.dp_size = int(micro_num), int(dp_rank), int(dp_size)
        self.num_rows = stream.rows_per_epoch
        global_batches = -(-self.num_rows // self.micro_num)
        self.num_batches = -(-global_batches // self.dp_size)

    def __len__(self) -> int:
        return self.num_batches

    @property
    def type_names(self) -> Dict[int, str]:
        return dict(self.table.type_names)

    def __iter__(self) -> Iterator[Batch]:
        for j in range(self.num_batches):
            g = j * self.dp_size + self.dp_rank
            rows = [self.packer.row(self.epoch, g * self.micro_num + m) for m in range(self.micro_num)]
            yield collate(rows, self.table.type_names)


def build_train_loader(data_cfg, *, dp_rank: int, dp_size: int, vocab_size: int):
    """The training loader of `data_cfg` (a DataConfig with its defaults filled) for one data-parallel rank.

    `data_cfg.num_worker > 0` prepares up to `2 * num_worker` batches ahead in a background thread.
    """
    if data_cfg.type == "streaming":
        return build_streaming_loader(data_cfg, dp_rank=dp_rank, dp_size=dp_size, vocab_size=vocab_size)
    shape = row_shape(data_cfg)
    seed = data_seed(data_cfg)
    folder = data_cfg.train_folder
    if folder is None:
        table, cache, where = dummy_table(data_cfg, vocab_size), None, "the dummy data"
    else:
        where = f"data.train_folder {folder}"
        files, per_file, names = list_folder(folder, data_cfg.dataset_type_mode, "data.train_folder")
        sources = open_files(files, verify=False)
        root = data_cfg.index_cache_folder or default_cache_root(folder)
        base = folder if os.path.isdir(folder) else os.path.dirname(folder)
        table, cache = scan_table(sources, per_file, names, base, root, data_cfg.min_length, where)
        logger.info("training data %s: %d files, %d documents, %d tokens, types %s", folder, len(sources),
                    table.num_docs, table.num_tokens, names)
    present = {t: table.type_names[t] for t in sorted(set(table.source_types.tolist()))}
    weights = data_cfg.dataset_weights
    all_sources = list(range(len(table.sources)))
    if weights:
        mixture = Mixture(weights, present, where)
        streams = []
        for t in mixture.types:
            if table.tokens_per_type.get(t, 0) == 0:
                raise DataError(f"data.dataset_weights[{present[t]!r}]: dataset type {present[t]!r} of {where} has "
                                f"no tokens (min_length={data_cfg.min_length})")
            members = [s for s in all_sources if int(table.source_types[s]) == t]
            streams.append(Stream(table, members, (seed, 1 + t), shape.packed_length, with_types=False))
        for st, t in zip(streams, mixture.types):
            rows_of(st, f"dataset type {present[t]!r} of {where}")
    else:
        mixture = None
        streams = [Stream(table, all_sources, (seed,), shape.packed_length, with_types=len(present) > 1)]
        rows_of(streams[0], "training data")
    return TrainLoader([EpochSource(st, cache) for st in streams], mixture, shape, micro_num=data_cfg.micro_num,
                       dp_rank=dp_rank, dp_size=dp_size, seed=seed, vocab_size=vocab_size,
                       type_names=table.type_names, prefetch=2 * max(0, int(data_cfg.num_worker or 0)),
                       rampup=Rampup(data_cfg.rampup_batch_size, data_cfg.micro_num)
                       if data_cfg.rampup_batch_size else None)


def build_valid_loaders(data_cfg, *, dp_rank: int, dp_size: int, vocab_size: int) -> Dict[str, Iterable[Batch]]:
    """{name: loader} for every validation subfolder of `data_cfg.valid_folder`.

    With neither `train_folder` nor `valid_folder` (dummy training data), InternLM validates on random data
    too: one "val" set of dummy documents drawn from another seed than the training stream (4 validation
    batches per rank). With real training data and no `valid_folder`, there is no validation ({}).
    """
    shape = row_shape(data_cfg)
    micro = data_cfg.valid_micro_num or data_cfg.micro_num
    tables = build_valid_tables(data_cfg)
    if data_cfg.valid_folder is None and data_cfg.train_folder is None:
        docs_per_row = 1 if data_cfg.fixed_random_dataset_seqlen else 2
        n = dp_size * micro * data_cfg.micro_bsz * docs_per_row * 4
        tables = {"val": dummy_table(data_cfg, vocab_size, seed_offset=1, num_samples=n)}
    return {name: ValidLoader(name, table, shape, micro_num=micro, dp_rank=dp_rank, dp_size=dp_size,
                              vocab_size=vocab_size)
            for name, table in tables.items()}
