"""Train and validation loaders: the interface the trainer consumes.

Training order (deterministic from `data.seed`): epoch e shuffles the documents with a generator seeded by
(seed, e) and packs them into `n_rows = tokens // packed_length` rows (the epoch's last partial row is dropped).
All rows of all epochs form one infinite sequence; optimizer step s on data-parallel rank r takes the
`micro_num` rows starting at ``consumed + (s * dp_size + r) * micro_num``. The loader's state is the number of rows
consumed by all ranks together, so resuming is exact (no replay, no repeats, no gaps) and even works with another
`dp_size`. The dataset is never too small: a step may take rows from two epochs.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Dict, Iterable, Iterator, List, Optional, TypedDict

import numpy as np
import torch

from internlm_core.errors import DataError
from internlm_core.utils.logging import get_logger

from .dataset import Corpus, DummySource, _seed, build_train_corpus, build_valid_corpora
from .packing import Packer, StreamOrder

logger = get_logger(__name__)


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


class TrainLoader:
    """Infinite iterator of training batches with an exact `state_dict` (see module docstring)."""

    STATE_VERSION = 1

    def __init__(self, corpus: Corpus, *, seq_len: int, packed_length: int, micro_num: int, dp_rank: int,
                 dp_size: int, seed: int, vocab_size: Optional[int], pack_sample_into_one: bool = False,
                 prefetch: int = 0):
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"data loader: dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
        if micro_num < 1:
            raise DataError(f"data.micro_num: expected >= 1, got {micro_num}")
        self.corpus = corpus
        self.packer = Packer(corpus, seq_len, packed_length, pack_sample_into_one, vocab_size)
        self.micro_num, self.dp_rank, self.dp_size = int(micro_num), int(dp_rank), int(dp_size)
        self.seed = int(seed)
        self.packed_length = int(packed_length)
        self.rows_per_epoch = corpus.num_tokens // self.packed_length
        if self.rows_per_epoch < 1:
            raise DataError(f"training data has {corpus.num_tokens} tokens, fewer than one packed row of "
                            f"{packed_length} tokens (data.seq_len * data.micro_bsz)")
        self.consumed = 0  # rows consumed by all ranks together
        self.prefetch = int(prefetch)
        self._orders: Dict[int, StreamOrder] = {}
        self._lock = threading.Lock()

    @property
    def type_names(self) -> Dict[int, str]:
        return dict(self.corpus.type_names)

    # -- order
    def _order(self, epoch: int) -> StreamOrder:
        with self._lock:
            o = self._orders.get(epoch)
            if o is None:
                rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
                n = self.corpus.num_docs
                perm = rng.permutation(n).astype(np.int32 if n < 2**31 else np.int64)
                o = StreamOrder(self.corpus, perm)
                self._orders = {k: v for k, v in self._orders.items() if k >= epoch - 1}
                self._orders[epoch] = o
            return o

    def epoch_of(self, consumed: Optional[int] = None) -> int:
        return (self.consumed if consumed is None else consumed) // self.rows_per_epoch

    def global_row(self, g: int) -> dict:
        epoch, k = divmod(g, self.rows_per_epoch)
        return self.packer.row(self._order(epoch), k)

    def batch_at(self, consumed: int) -> Batch:
        """This rank's batch of the step that starts after `consumed` rows."""
        first = consumed + self.dp_rank * self.micro_num
        rows = [self.global_row(first + m) for m in range(self.micro_num)]
        return collate(rows, self.corpus.type_names)

    @property
    def rows_per_step(self) -> int:
        return self.micro_num * self.dp_size

    # -- iteration
    def __iter__(self) -> Iterator[Batch]:
        if self.prefetch <= 0:
            while True:
                batch = self.batch_at(self.consumed)
                self.consumed += self.rows_per_step
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
                        c += self.rows_per_step
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
                    self.consumed = expected = c + self.rows_per_step
                    yield item
            finally:
                stop.set()
                t.join(timeout=5)

    # -- state
    def state_dict(self) -> Dict[str, Any]:
        return {"version": self.STATE_VERSION, "rows_consumed": int(self.consumed), "epoch": int(self.epoch_of()),
                "seed": self.seed, "packed_length": self.packed_length, "rows_per_epoch": int(self.rows_per_epoch),
                "num_docs": int(self.corpus.num_docs), "num_tokens": int(self.corpus.num_tokens),
                "dp_size": self.dp_size, "micro_num": self.micro_num}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Resume after `sd["rows_consumed"]` rows (also while an iterator is open: it continues from there)."""
        if "rows_consumed" not in sd:
            raise DataError(f"data loader state: missing 'rows_consumed' (keys: {sorted(sd)})")
        mine = self.state_dict()
        changed = [k for k in ("seed", "packed_length", "num_docs", "num_tokens")
                   if k in sd and int(sd[k]) != mine[k]]
        if changed:
            logger.warning("data loader state: %s changed since the checkpoint (%s); resuming after %d rows of the "
                           "new order", ", ".join(changed),
                           ", ".join(f"{k}: {int(sd[k])} -> {mine[k]}" for k in changed), int(sd["rows_consumed"]))
        if "dp_size" in sd and int(sd["dp_size"]) * int(sd.get("micro_num", self.micro_num)) != self.rows_per_step:
            logger.info("data loader state: rows per step changed from %d to %d; continuing without gaps",
                        int(sd["dp_size"]) * int(sd.get("micro_num", self.micro_num)), self.rows_per_step)
        self.consumed = int(sd["rows_consumed"])


class ValidLoader:
    """A finite, re-iterable loader over one validation corpus, in order, split over data-parallel ranks.

    Rows are the corpus's stream cut every `packed_length` tokens, the last one padded. Global batch g holds rows
    ``[g * micro_num, (g + 1) * micro_num)`` and goes to rank ``g % dp_size``; every rank gets the same number of
    batches (rows past the end are all padding, labels all -100), so that collective ops stay in step.
    """

    def __init__(self, name: str, corpus: Corpus, *, seq_len: int, packed_length: int, micro_num: int,
                 dp_rank: int, dp_size: int, vocab_size: Optional[int], pack_sample_into_one: bool = False):
        self.name = name
        self.corpus = corpus
        self.packer = Packer(corpus, seq_len, packed_length, pack_sample_into_one, vocab_size)
        self.order = StreamOrder(corpus, None)
        self.micro_num, self.dp_rank, self.dp_size = int(micro_num), int(dp_rank), int(dp_size)
        self.num_rows = -(-self.order.total // packed_length)
        global_batches = -(-self.num_rows // self.micro_num)
        self.num_batches = -(-global_batches // self.dp_size)

    def __len__(self) -> int:
        return self.num_batches

    @property
    def type_names(self) -> Dict[int, str]:
        return dict(self.corpus.type_names)

    def __iter__(self) -> Iterator[Batch]:
        for j in range(self.num_batches):
            g = j * self.dp_size + self.dp_rank
            rows = [self.packer.row(self.order, g * self.micro_num + m) for m in range(self.micro_num)]
            yield collate(rows, self.corpus.type_names)


def build_train_loader(data_cfg, *, dp_rank: int, dp_size: int, vocab_size: int) -> TrainLoader:
    """The training loader of `data_cfg` (a DataConfig with its defaults filled) for one data-parallel rank.

    `data_cfg.num_worker > 0` prepares up to `2 * num_worker` batches ahead in a background thread.
    """
    corpus = build_train_corpus(data_cfg, vocab_size)
    packed_length = data_cfg.packed_length or data_cfg.seq_len * data_cfg.micro_bsz
    return TrainLoader(corpus, seq_len=data_cfg.seq_len, packed_length=packed_length, micro_num=data_cfg.micro_num,
                       dp_rank=dp_rank, dp_size=dp_size, seed=data_cfg.seed if data_cfg.seed is not None else 1024,
                       vocab_size=vocab_size, pack_sample_into_one=data_cfg.pack_sample_into_one,
                       prefetch=2 * max(0, int(data_cfg.num_worker or 0)))


def build_valid_loaders(data_cfg, *, dp_rank: int, dp_size: int, vocab_size: int) -> Dict[str, Iterable[Batch]]:
    """{name: loader} for every validation subfolder of `data_cfg.valid_folder`.

    With neither `train_folder` nor `valid_folder` (dummy training data), InternLM validates on random data
    too: one "val" set of dummy documents drawn from another seed than the training stream (4 validation
    batches per rank). With real training data and no `valid_folder`, there is no validation ({}).
    """
    packed_length = data_cfg.packed_length or data_cfg.seq_len * data_cfg.micro_bsz
    micro = data_cfg.valid_micro_num or data_cfg.micro_num
    corpora = build_valid_corpora(data_cfg)
    if data_cfg.valid_folder is None and data_cfg.train_folder is None:
        docs_per_row = 1 if data_cfg.fixed_random_dataset_seqlen else 2
        n = dp_size * micro * data_cfg.micro_bsz * docs_per_row * 4
        src = DummySource(n, data_cfg.seq_len, vocab_size, _seed(data_cfg) + 1, data_cfg.fixed_random_dataset_seqlen,
                          data_cfg.dummy_distribution)
        corpora = {"val": Corpus.from_sources([src], [0], {0: "dummy"}, data_cfg.min_length, "dummy validation data")}
    return {name: ValidLoader(name, corpus, seq_len=data_cfg.seq_len, packed_length=packed_length, micro_num=micro,
                              dp_rank=dp_rank, dp_size=dp_size, vocab_size=vocab_size,
                              pack_sample_into_one=data_cfg.pack_sample_into_one)
            for name, corpus in corpora.items()}
