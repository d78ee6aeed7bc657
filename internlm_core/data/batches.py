"""What loaders hand the trainer (`Batch`, `collate`) and their iteration (`Prefetch`: a batch per step, optionally
prepared ahead by a background thread)."""

from __future__ import annotations

import queue
import threading
from typing import Dict, Iterator, List, TypedDict

import numpy as np
import torch

from .packing import RowShape


class Batch(TypedDict):
    """One optimizer step's data for one data-parallel rank (see internlm_core.data.packing)."""

    input_ids: torch.Tensor      # int64 [micro_num, packed_length]
    labels: torch.Tensor         # int64 [micro_num, packed_length], shifted, -100 = no loss
    position_ids: torch.Tensor   # int64 [micro_num, packed_length]
    type_ids: torch.Tensor       # int64 [micro_num, packed_length]
    cu_seqlens: List[torch.Tensor]  # micro_num int32 tensors, 0 ... packed_length
    type_names: Dict[int, str]


def collate(rows: list, type_names: dict) -> Batch:
    return Batch(
        input_ids=torch.from_numpy(np.stack([r["input_ids"] for r in rows])),
        labels=torch.from_numpy(np.stack([r["labels"] for r in rows])),
        position_ids=torch.from_numpy(np.stack([r["position_ids"] for r in rows])),
        type_ids=torch.from_numpy(np.stack([r["type_ids"] for r in rows])),
        cu_seqlens=[torch.from_numpy(np.ascontiguousarray(r["cu_seqlens"], dtype=np.int32)) for r in rows],
        type_names=dict(type_names),
    )


class Prefetch:
    """Iteration over `batch_at(consumed)`, optionally prepared ahead by a background thread."""

    consumed: int
    prefetch: int

    def batch_at(self, consumed: int) -> Batch:
        raise NotImplementedError

    @property
    def rows_per_step(self) -> int:
        return self.micro_num * self.dp_size

    def rows_at(self, consumed: int) -> int:
        """Rows of all ranks taken by the step that starts after `consumed` (varies under a batch-size ramp-up)."""
        return self.rows_per_step

    def __iter__(self) -> Iterator[Batch]:
        if self.prefetch <= 0:
            while True:
                batch = self.batch_at(self.consumed)
                self.consumed += self.rows_at(self.consumed)
                yield batch
        else:
            yield from self._prefetching()

    def _prefetching(self) -> Iterator[Batch]:
        """Batches prepared by a background thread; restarts it if `load_state_dict` moved the position."""
        while True:
            start = self.consumed
            q: "queue.Queue" = queue.Queue(maxsize=self.prefetch)
            stop = threading.Event()

            def put(item, q=q, stop=stop) -> bool:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        return True
                    except queue.Full:
                        pass
                return False

            def work(start=start, put=put, stop=stop):
                c = start
                try:
                    while not stop.is_set():
                        if not put((c, self.batch_at(c))):
                            return
                        c += self.rows_at(c)
                except BaseException as e:  # handed to the consumer, re-raised there
                    put((None, e))

            t = threading.Thread(target=work, name="internlm_core-data", daemon=True)
            t.start()
            try:
                expected = start
                while self.consumed == expected:
                    c, item = q.get()
                    if c is None:
                        raise item
                    self.consumed = expected = c + self.rows_at(c)
                    yield item
            finally:
                stop.set()
                t.join(timeout=5)


def row_shape(data_cfg) -> RowShape:
    """The row shape of a DataConfig (packed_length defaults to seq_len * micro_bsz)."""
    return RowShape(data_cfg.seq_len, data_cfg.packed_length or data_cfg.seq_len * data_cfg.micro_bsz,
                    data_cfg.pack_sample_into_one)
