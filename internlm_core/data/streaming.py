"""Streaming training data (``data.type="streaming"``, as InternEvo): raw text tokenized on the fly, no offline step.

Sources under `train_folder`, walked in sorted order: ``.jsonl`` / ``.jsonl.gz`` (one JSON record per line),
``.txt`` / ``.txt.gz`` (one document per non-empty line), ``.parquet``, and Hugging Face `datasets` folders as
`save_to_disk` writes them (``state.json`` with its ``.arrow`` files; a ``dataset_dict.json`` folder uses its
``train`` split). The text of a record is its `data.content_name` field. Dataset types are named as for tokenized
data (`data.dataset_type_mode`), and `data.dataset_weights` mixes them as the tokenized path does (mixture.py).

Every document becomes BOS + tokens + EOS (those the tokenizer has) and is packed exactly as the pre-tokenized path
packs (packing.RowShape.assemble): rows of `packed_length` tokens cut from the stream of documents, which runs
through the sources in order and starts over (epoch + 1) at the end. The global rows are those of the tokenized
path's contract: step s on rank r takes rows ``consumed + r * micro_num ...``, so every rank reads and tokenizes
the whole stream and keeps its own rows (the order does not depend on the number of ranks). The state is, for each
stream, the position of the document holding the next row's first token (source, record, byte offset of a
jsonl/txt line, token offset): resuming seeks there, with any number of ranks. Reading ahead and tokenizing run in
a background thread when `data.num_worker > 0` (the tokenizer then uses `num_worker` threads).
"""

from __future__ import annotations

import gzip
import json
import os
from typing import Any, Dict, Iterator, List, Optional

import numpy as np

from internlm_core.errors import DataError
from internlm_core.utils.logging import get_logger

from .dataset import data_seed, type_names_for
from .batches import Prefetch, collate, row_shape
from .mixture import Mixture
from .packing import IGNORE_INDEX, Fragment, check_vocab
from .tokenizers import load_tokenizer

logger = get_logger(__name__)

TEXT_EXTS = (".jsonl", ".jsonl.gz", ".txt", ".txt.gz", ".parquet")
BATCH_RECORDS = 256  # records tokenized together


def find_sources(folder: str) -> List[str]:
    """Every source under `folder` in sorted order: files by extension, Hugging Face dataset folders whole."""
    if os.path.isfile(folder):
        return [folder]
    if not os.path.isdir(folder):
        raise DataError(f"data.train_folder {folder}: no such folder")
    out = []
    for root, dirs, files in os.walk(folder, followlinks=True):
        dirs.sort()
        if "state.json" in files or "dataset_dict.json" in files:
            out.append(root)
            dirs[:] = []
            continue
        out.extend(os.path.join(root, f) for f in sorted(files) if f.endswith(TEXT_EXTS))
    if not out:
        raise DataError(f"data.train_folder {folder}: no streaming sources (.jsonl, .txt, .parquet, optionally .gz, "
                        "or Hugging Face datasets folders) found")
    return out


def _text(rec: Any, key: str, where: str) -> str:
    if not isinstance(rec, dict) or key not in rec:
        raise DataError(f"{where}: expected a record with a {key!r} field (data.content_name)")
    if not isinstance(rec[key], str):
        raise DataError(f"{where}: field {key!r} is {type(rec[key]).__name__}, expected a string")
    return rec[key]


def read_records(path: str, key: str, record: int = 0, offset: Optional[int] = None) -> Iterator[tuple]:
    """(record index, byte offset or None, text) of the source from `record` on (`offset`: where it starts)."""
    if os.path.isdir(path):
        yield from _read_hf(path, key, record)
        return
    if path.endswith(".parquet"):
        yield from _read_parquet(path, key, record)
        return
    compressed = path.endswith(".gz")
    is_json = ".jsonl" in os.path.basename(path)
    with (gzip.open(path, "rb") if compressed else open(path, "rb")) as fh:
        i, pos = 0, 0
        if offset is not None and not compressed:
            fh.seek(offset)
            i, pos = record, offset
        for raw in fh:
            start, pos = pos, pos + len(raw)
            i += 1
            if i - 1 < record or not raw.strip():
                continue
            where = f"{path}:{i}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{where}: not valid UTF-8") from None
            if is_json:
                try:
                    text = _text(json.loads(line), key, where)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: malformed JSON at column {e.colno}: {e.msg}") from None
            else:
                text = line.strip()
            yield i - 1, start, text


def _arrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("streaming parquet or Hugging Face datasets folders needs pyarrow (pip install pyarrow)") from None
    return pa, pq


def _read_parquet(path: str, key: str, record: int) -> Iterator[tuple]:
    _, pq = _arrow()
    try:
        f = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError with its own text
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    if key not in f.schema_arrow.names:
        raise DataError(f"{path}: has no column {key!r} (data.content_name); its columns: {f.schema_arrow.names}")
    base = 0
    for g in range(f.num_row_groups):
        n = f.metadata.row_group(g).num_rows
        if base + n > record:
            col = f.read_row_group(g, columns=[key]).column(0).to_pylist()
            for j in range(max(0, record - base), n):
                if not isinstance(col[j], str):
                    raise DataError(f"{path}: row {base + j}: column {key!r} is not a string")
                yield base + j, None, col[j]
        base += n


def _hf_files(folder: str) -> List[str]:
    if os.path.exists(os.path.join(folder, "dataset_dict.json")):
        with open(os.path.join(folder, "dataset_dict.json")) as fh:
            splits = json.load(fh).get("splits", [])
        if "train" not in splits:
            raise DataError(f"{folder}: a DatasetDict without a 'train' split (its splits: {splits})")
        folder = os.path.join(folder, "train")
    try:
        with open(os.path.join(folder, "state.json")) as fh:
            files = [d["filename"] for d in json.load(fh)["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{folder}/state.json: not a Hugging Face dataset folder ({e})") from None
    return [os.path.join(folder, f) for f in files]


def _read_hf(folder: str, key: str, record: int) -> Iterator[tuple]:
    pa, _ = _arrow()
    base = 0
    for path in _hf_files(folder):
        try:
            source = pa.memory_map(path)
            try:
                reader = pa.ipc.open_stream(source)
            except pa.ArrowInvalid:
                reader = pa.ipc.open_file(source)
                reader = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except Exception as e:  # pyarrow's own errors
            raise DataError(f"{path}: not a readable arrow file ({e})") from None
        for batch in reader:
            n = batch.num_rows
            if base + n > record:
                if key not in batch.schema.names:
                    raise DataError(f"{path}: has no column {key!r} (data.content_name); its columns: "
                                    f"{batch.schema.names}")
                col = batch.column(batch.schema.get_field_index(key)).to_pylist()
                for j in range(max(0, record - base), n):
                    if not isinstance(col[j], str):
                        raise DataError(f"{folder}: row {base + j}: column {key!r} is not a string")
                    yield base + j, None, col[j]
            base += n


class _Cursor:
    """One stream's documents in order, packed into rows; `state()` at a row boundary resumes exactly."""

    def __init__(self, sources: List[str], types: List[int], tokenizer, key: str, min_length: int, threads: int):
        self.sources, self.types, self.tok, self.key = sources, types, tokenizer, key
        self.min_length, self.threads = max(1, int(min_length)), threads
        self.pre = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
        self.post = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
        self.seek({"epoch": 0, "source": 0, "record": 0, "offset": None, "token": 0})

    def seek(self, st: Dict[str, Any]) -> None:
        self._docs = self._documents(int(st["epoch"]), int(st["source"]), int(st["record"]), st.get("offset"))
        self._cur = next(self._docs)
        self._tok = int(st.get("token", 0))

    def state(self) -> Dict[str, Any]:
        pos, _, _ = self._cur
        return dict(pos, token=self._tok)

    def _documents(self, epoch: int, source: int, record: int, offset) -> Iterator[tuple]:
        """(position, tokens, type id) of every document from a position on, epoch after epoch."""
        while True:
            found = False
            for s in range(source, len(self.sources)):
                batch: list = []
                for i, off, text in read_records(self.sources[s], self.key, record if s == source else 0,
                                                 offset if s == source else None):
                    batch.append(({"epoch": epoch, "source": s, "record": i, "offset": off}, text))
                    if len(batch) >= BATCH_RECORDS:
                        for d in self._encode(batch, s):
                            found = True
                            yield d
                        batch = []
                for d in self._encode(batch, s):
                    found = True
                    yield d
            if not found and source == 0 and record == 0:
                raise DataError(f"streaming data {', '.join(self.sources[:3])}: no documents of at least "
                                f"{self.min_length} tokens")
            epoch, source, record, offset = epoch + 1, 0, 0, None

    def _encode(self, batch: list, s: int) -> Iterator[tuple]:
        if not batch:
            return
        for (pos, _), ids in zip(batch, self.tok.encode_batch([t for _, t in batch], self.threads)):
            toks = np.concatenate([np.asarray(self.pre, np.int64), np.asarray(ids, np.int64),
                                   np.asarray(self.post, np.int64)])
            if len(toks) >= self.min_length and len(toks):
                yield pos, toks, self.types[s]

    def take(self, need: int, build: bool, counts: Dict[int, int], vocab: Optional[int]) -> List[Fragment]:
        """The next `need` tokens as fragments (only when `build`), counting tokens per type."""
        frags = []
        while need:
            pos, toks, t = self._cur
            n = min(len(toks) - self._tok, need)
            if build:
                piece = toks[self._tok:self._tok + n]
                check_vocab(piece, vocab, lambda: f"{self.sources[pos['source']]}: record {pos['record']}", self._tok)
                last = toks[self._tok + n] if self._tok + n < len(toks) else IGNORE_INDEX
                frags.append(Fragment(piece, t, last))
            counts[t] = counts.get(t, 0) + n
            need -= n
            self._tok += n
            if self._tok == len(toks):
                self._cur, self._tok = next(self._docs), 0
        return frags


class StreamingLoader(Prefetch):
    """The streaming training loader: the tokenized loader's interface, state and row contract."""

    STATE_VERSION = 1

    def __init__(self, cursors: List[_Cursor], mixture: Optional[Mixture], shape, *, micro_num: int, dp_rank: int,
                 dp_size: int, vocab_size: Optional[int], type_names: Dict[int, str], stream_types: List[int],
                 prefetch: int = 0):
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"data loader: dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
        self.cursors, self.mixture, self.shape = cursors, mixture, shape
        self.micro_num, self.dp_rank, self.dp_size = int(micro_num), int(dp_rank), int(dp_size)
        self.vocab_size, self._type_names, self.stream_types = vocab_size, dict(type_names), stream_types
        self.packed_length = shape.packed_length
        self.prefetch = int(prefetch)
        self.consumed = 0
        self._next = 0  # the global row the cursors stand at
        self._counts: Dict[int, int] = {}
        self._snapshots = {0: self._snapshot()}

    @property
    def type_names(self) -> Dict[int, str]:
        return dict(self._type_names)

    def _snapshot(self) -> Dict[str, Any]:
        return {"rows_consumed": self._next, "streams": [c.state() for c in self.cursors],
                "tokens_per_type": {n: int(self._counts.get(t, 0)) for t, n in self._type_names.items()}}

    def _restore(self, snap: Dict[str, Any]) -> None:
        if len(snap["streams"]) != len(self.cursors):
            raise DataError(f"streaming loader state: {len(snap['streams'])} streams saved, {len(self.cursors)} "
                            "configured (did data.dataset_weights or the folder change?)")
        for c, st in zip(self.cursors, snap["streams"]):
            c.seek(st)
        ids = {n: t for t, n in self._type_names.items()}
        self._counts = {ids[n]: int(v) for n, v in snap.get("tokens_per_type", {}).items() if n in ids}
        self._next = int(snap["rows_consumed"])

    def _row(self, build: bool) -> Optional[dict]:
        i = self.mixture.locate(self._next)[0] if self.mixture is not None else 0
        frags = self.cursors[i].take(self.packed_length, build, self._counts, self.vocab_size)
        self._next += 1
        return self.shape.assemble(frags) if build else None

    def batch_at(self, consumed: int):
        """This rank's batch of the step starting after `consumed` global rows (the cursors move to there)."""
        if consumed != self._next:
            snap = self._snapshots.get(consumed)
            if snap is None or consumed < self._next:
                snap = max((s for c, s in self._snapshots.items() if c <= consumed), key=lambda s: s["rows_consumed"])
            self._restore(snap)
            while self._next < consumed:
                self._row(False)
        first = consumed + self.dp_rank * self.micro_num
        rows = []
        while self._next < consumed + self.rows_per_step:
            mine = first <= self._next < first + self.micro_num
            r = self._row(mine)
            if mine:
                rows.append(r)
        self._snapshots[self._next] = self._snapshot()
        for c in [c for c in list(self._snapshots) if 0 < c < min(consumed, self.consumed)]:
            self._snapshots.pop(c, None)  # positions before the consumer's are no longer needed
        return collate(rows, self._type_names)

    def consumed_tokens_per_type(self) -> Dict[str, int]:
        snap = self._snapshots.get(self.consumed)
        if snap is None:
            snap = self._snapshot()
        return dict(snap["tokens_per_type"])

    def state_dict(self) -> Dict[str, Any]:
        snap = self._snapshots.get(self.consumed)
        if snap is None:
            raise DataError(f"streaming loader: no saved position for row {self.consumed}")
        return dict(snap, version=self.STATE_VERSION, packed_length=self.packed_length, dp_size=self.dp_size,
                    micro_num=self.micro_num, sources=[c.sources for c in self.cursors])

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if "streams" not in sd or "rows_consumed" not in sd:
            raise DataError(f"streaming loader state: missing 'streams'/'rows_consumed' (keys: {sorted(sd)}); "
                            "was it saved by the tokenized loader?")
        self._restore(sd)
        self.consumed = int(sd["rows_consumed"])
        self._snapshots = {0: self._snapshots.get(0), self.consumed: self._snapshot()}


def build_streaming_loader(data_cfg, *, dp_rank: int, dp_size: int, vocab_size: int) -> StreamingLoader:
    """The streaming training loader of `data_cfg` (see the module docstring)."""
    folder = data_cfg.train_folder
    if folder is None or not data_cfg.tokenizer_path:
        raise DataError("data.type='streaming' needs data.train_folder and data.tokenizer_path")
    sources = find_sources(folder)
    base = folder if os.path.isdir(folder) else os.path.dirname(folder)
    names, per_source = type_names_for(base, sources, data_cfg.dataset_type_mode)
    names = {t: n for t, n in names.items() if t in set(per_source)}
    tok = load_tokenizer(data_cfg.tokenizer_path)
    threads = max(1, int(data_cfg.num_worker or 0))
    where = f"data.train_folder {folder}"

    def cursor(members: List[int]) -> _Cursor:
        return _Cursor([sources[i] for i in members], [per_source[i] for i in members], tok, data_cfg.content_name,
                       data_cfg.min_length, threads)

    if data_cfg.dataset_weights:
        mixture = Mixture(data_cfg.dataset_weights, names, where)
        cursors = [cursor([i for i, t in enumerate(per_source) if t == ty]) for ty in mixture.types]
        stream_types = list(mixture.types)
    else:
        mixture, cursors, stream_types = None, [cursor(list(range(len(sources))))], sorted(names)
    logger.info("streaming data %s: %d sources, types %s, tokenizer %s (seed %d unused: streams are read in order)",
                folder, len(sources), names, tok.name, data_seed(data_cfg))
    return StreamingLoader(cursors, mixture, row_shape(data_cfg), micro_num=data_cfg.micro_num, dp_rank=dp_rank,
                           dp_size=dp_size, vocab_size=vocab_size, type_names=names, stream_types=stream_types,
                           prefetch=2 * max(0, int(data_cfg.num_worker or 0)))
