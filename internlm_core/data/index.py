"""The training order, built once per version of the data and read from disk by every rank.

Two layers, each a folder of the index cache (``data.index_cache_folder``; default ``.index_cache`` inside the
training folder, or ``~/.cache/internlm_core/index/...`` when that folder is not writable):

``<data key>/``            the scan of the files: ``lengths.npy`` (int32 effective length of every document, 0 when
                           shorter than `min_length`) and ``scan.json`` (documents and tokens per file). The key is a
                           hash of every file's fingerprint (size, modification time, file id / checksum or a digest
                           of its index) and `min_length`: data that changed gets a new key, so a stale scan is
                           never used; it is rebuilt.
``<data key>/<order key>/epoch-<e>/``
                           one stream's epoch e (the key hashes the seed, the packed length and which files the stream
                           holds): ``order.npy`` (the global id of the j-th document of the epoch), ``rows.npy``
                           (for packed row k: the order position of its first document and the token offset in it),
                           ``typecum.npy`` (when several dataset types share the stream: tokens of each type before
                           each row start, for the per-type token counts).

Whoever needs a missing folder builds it under an exclusive `flock` on a lock file beside it (one rank builds,
the others of its node, or of the job on a shared file system, wait and then read it); a folder is written under a
temporary name and renamed when complete. While epoch e trains, epoch e + 1 is built in a background thread. Every rank then reads single entries with `pread` (tokenfile.FileArray):
its memory does not grow with the corpus, and start-up with a built cache reads a few headers.

The order of an epoch: a uniform permutation of the stream's documents (seeded by (seed, epoch, stream)) when it
has at most `FULL_SHUFFLE` of them; beyond that a two-level shuffle with bounded memory, as streaming datasets do:
blocks of consecutive documents are put in a random order, and the documents of each window of `WINDOW` documents
(blocks from all over the corpus) are shuffled among themselves. Rows are the epoch's token stream cut every
`packed_length` tokens; the last partial row of an epoch is dropped (validation keeps and pads it).
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np

from internlm_core.errors import DataError
from internlm_core.utils.logging import get_logger

from .dataset import CACHE_DIR_NAME, DocTable, no_documents_message
from .tokenfile import CHUNK, VERIFY_MAX_BYTES, FileArray, NpyWriter, npy_array

logger = get_logger(__name__)

CACHE_VERSION = 1
FULL_SHUFFLE = 1 << 20  # streams with at most this many documents get a uniform permutation
WINDOW = 1 << 18        # documents shuffled together in the two-level shuffle
SUB = 1 << 16           # documents processed at once when rows are computed


# ------------------------------------------------------------------------------------------------------- the cache

def default_cache_root(train_folder: str) -> str:
    """``<train_folder>/.index_cache`` if it can be written, else a folder under ``~/.cache`` named by the path."""
    base = train_folder if os.path.isdir(train_folder) else os.path.dirname(os.path.abspath(train_folder))
    here = os.path.join(base, CACHE_DIR_NAME)
    try:
        os.makedirs(here, exist_ok=True)
        if os.access(here, os.W_OK):
            return here
    except OSError:
        pass
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    tag = hashlib.sha1(os.path.abspath(base).encode()).hexdigest()[:16]
    return os.path.join(home, "internlm_core", "index", tag)


def _key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:24]


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive lock on `path` (created if missing) for the duration."""
    import fcntl

    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _build_once(final: str, build) -> None:
    """Run `build(tmp_folder)` unless `final` exists, under a lock; `final` appears complete or not at all."""
    if os.path.isdir(final):
        return
    parent = os.path.dirname(final)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise DataError(f"data.index_cache_folder: cannot create {parent} ({e.strerror})") from None
    with _locked(final + ".lock"):
        if os.path.isdir(final):
            return
        base = os.path.basename(final) + ".tmp-"
        for stale in os.listdir(parent):  # left by a builder that died: nobody else builds it while we hold the lock
            if stale.startswith(base):
                shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
        tmp = f"{final}.tmp-{socket.gethostname()}-{os.getpid()}"
        os.makedirs(tmp)
        try:
            build(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _write_json(path: str, obj) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=1)


def scan_table(sources: list, source_types: Sequence[int], type_names: dict, root_folder: str, cache_root: str,
               min_length: int, what: str) -> tuple[DocTable, str]:
    """The training table of `sources`, its effective lengths from the cache (scanned now if needed).

    Returns (table, folder of this data version in the cache).
    """
    fingerprint = [[os.path.relpath(s.path, root_folder), s.fingerprint()] for s in sources]
    folder = os.path.join(cache_root, _key({"v": CACHE_VERSION, "min_length": int(min_length), "files": fingerprint}))
    scan = os.path.join(folder, "scan")
    t0 = time.perf_counter()

    def build(tmp: str) -> None:
        logger.info("%s: building the index cache %s (once per version of the data)", what, folder)
        verify = sum(os.path.getsize(s.path) for s in sources) <= VERIFY_MAX_BYTES
        keep_min = max(1, int(min_length))
        out = NpyWriter(os.path.join(tmp, "lengths.npy"), "<i4", sum(s.num_docs for s in sources))
        per_source = []
        for s in sources:
            if verify:
                s.check()
            kept_docs = kept_tokens = 0
            for a in range(0, s.num_docs, CHUNK):
                lens = np.asarray(s.read_lengths(a, a + CHUNK), dtype=np.int64)
                if len(lens) and lens.max() >= 2**31:
                    raise DataError(f"{s.path}: document {a + int(lens.argmax())} has {int(lens.max())} tokens; "
                                    "documents longer than 2**31 tokens are not supported")
                eff = np.where(lens >= keep_min, lens, 0)
                kept_docs += int(np.count_nonzero(eff))
                kept_tokens += int(eff.sum())
                out.write(eff)
            if kept_docs < s.num_docs:
                logger.info("%s: dropped %d of %d documents shorter than %d tokens", s.path, s.num_docs - kept_docs,
                            s.num_docs, keep_min)
            per_source.append({"path": os.path.relpath(s.path, root_folder), "format": s.format,
                               "num_docs": int(s.num_docs), "kept_docs": kept_docs, "kept_tokens": kept_tokens})
        out.close()
        _write_json(os.path.join(tmp, "scan.json"),
                    {"version": CACHE_VERSION, "fingerprint": fingerprint, "min_length": int(min_length),
                     "checked": verify, "sources": per_source, "built_by": f"{socket.gethostname()}:{os.getpid()}"})

    _build_once(scan, build)
    with open(os.path.join(scan, "scan.json")) as fh:
        meta = json.load(fh)
    if meta.get("fingerprint") != fingerprint or len(meta.get("sources", [])) != len(sources):
        raise DataError(f"{scan}: the index cache does not match the data (remove the folder to rebuild it)")
    lengths = npy_array(os.path.join(scan, "lengths.npy"), block=1024, cache_blocks=16)
    table = DocTable(sources, source_types, type_names, lengths, [int(m["kept_tokens"]) for m in meta["sources"]],
                     min_length)
    if table.num_tokens == 0:
        raise DataError(no_documents_message(what, sources, min_length))
    logger.info("%s: index cache %s ready in %.2f s", what, scan, time.perf_counter() - t0)
    return table, folder


# ---------------------------------------------------------------------------------------------------- the epochs

@dataclass
class Stream:
    """Which documents of a table are shuffled and packed together: whole sources, each one range of ids."""

    table: DocTable
    sources: list           # indices into table.sources
    seed: tuple             # the generator's seed words before the epoch: (seed,) or (seed, 1 + type id)
    packed_length: int
    with_types: bool        # keep per-type token counts (several types share the stream)
    keep_tail: bool = False  # validation: the last partial row is kept (padded)
    shuffle: bool = True
    fixed_order: Optional[np.ndarray] = None  # an explicit order of global ids (tests)

    def __post_init__(self):
        self.ranges = [self.table.source_range(s) for s in self.sources]
        self.mstarts = np.concatenate([[0], np.cumsum([b - a for a, b in self.ranges])]).astype(np.int64)
        self._mstarts = self.mstarts.tolist()
        self.num_docs = int(self.mstarts[-1])
        self.num_tokens = self._tokens()
        P = self.packed_length
        self.rows_per_epoch = -(-self.num_tokens // P) if self.keep_tail else self.num_tokens // P
        self.types = sorted({int(self.table.source_types[s]) for s in self.sources})

    def _tokens(self) -> int:
        return int(sum(self.table.source_tokens[s] for s in self.sources))

    def key(self) -> dict:
        return {"v": CACHE_VERSION, "sources": self.sources, "seed": list(self.seed), "P": self.packed_length,
                "types": self.with_types, "tail": self.keep_tail, "shuffle": self.shuffle,
                "full": FULL_SHUFFLE, "window": WINDOW}

    def to_global(self, m: np.ndarray) -> np.ndarray:
        idx = np.searchsorted(self.mstarts, m, side="right") - 1
        base = np.asarray([a for a, _ in self.ranges], dtype=np.int64)
        return base[idx] + (m - self.mstarts[idx])

    def member_lengths(self, m0: int, m1: int) -> np.ndarray:
        i = bisect.bisect_right(self._mstarts, m0) - 1
        out = []
        while m0 < m1:
            a, hi = self.ranges[i][0], self._mstarts[i + 1]
            stop = min(m1, hi)
            out.append(self.table.lengths_range(a + m0 - self._mstarts[i], a + stop - self._mstarts[i]))
            m0, i = stop, i + 1
        return out[0] if len(out) == 1 else np.concatenate(out) if out else np.zeros(0, np.int64)

    def order_chunks(self, epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(global ids, lengths) of the epoch's documents in order, in chunks of bounded size."""
        M = self.num_docs
        if self.fixed_order is not None:
            order = np.asarray(self.fixed_order, dtype=np.int64)
            yield order, np.asarray([self.table.length(int(g)) for g in order], dtype=np.int64)
            return
        if not self.shuffle:
            for m0 in range(0, M, SUB):
                m1 = min(M, m0 + SUB)
                yield self.to_global(np.arange(m0, m1, dtype=np.int64)), self.member_lengths(m0, m1)
            return
        rng = np.random.Generator(np.random.PCG64([*self.seed, epoch]))
        if M <= FULL_SHUFFLE:
            perm = rng.permutation(M)
            lens = self.member_lengths(0, M)
            yield self.to_global(perm), lens[perm]
            return
        B = max(64, -(-M // FULL_SHUFFLE))
        nb = -(-M // B)
        per_window = max(1, WINDOW // B)
        blocks = rng.permutation(nb)
        for w in range(0, nb, per_window):
            bl = blocks[w:w + per_window]
            ids_a = (bl[:, None] * B + np.arange(B)[None, :]).ravel()
            ids_a = ids_a[ids_a < M]  # the last block may be short
            lens_a = np.concatenate([self.member_lengths(b * B, min(M, (b + 1) * B)) for b in bl.tolist()])
            p = rng.permutation(len(ids_a))
            yield self.to_global(ids_a[p]), lens_a[p]


class EpochIndex:
    """One epoch of a stream: `doc(j)` (global id of the j-th document), `row_start(k)` → (j, token offset),
    `type_counts(k)` → tokens of each of the stream's types before row k (None without per-type counts)."""

    def __init__(self, order, rows, typecum, num_rows: int, total: int, types: list):
        self.order, self.rows, self.typecum = order, rows, typecum
        self.num_rows, self.total, self.types = int(num_rows), int(total), list(types)
        self.num_docs = len(order)

    def doc(self, j: int) -> int:
        return int(self.order[j])

    def row_start(self, k: int) -> tuple[int, int]:
        r = self.rows[2 * k: 2 * k + 2]
        return int(r[0]), int(r[1])

    def type_counts(self, k: int) -> Optional[np.ndarray]:
        if self.typecum is None:
            return None
        T = len(self.types)
        return np.asarray(self.typecum[k * T:(k + 1) * T], dtype=np.int64)

    @classmethod
    def open(cls, folder: str) -> "EpochIndex":
        with open(os.path.join(folder, "epoch.json")) as fh:
            meta = json.load(fh)
        tc = os.path.join(folder, "typecum.npy")
        return cls(npy_array(os.path.join(folder, "order.npy"), block=4096, cache_blocks=2),
                   npy_array(os.path.join(folder, "rows.npy"), block=1024, cache_blocks=2),
                   npy_array(tc, block=1024, cache_blocks=2) if os.path.exists(tc) else None,
                   meta["num_rows"], meta["total"], meta["types"])


def _epoch_parts(stream: Stream, epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]]:
    """(order chunk, rows chunk as flat (j, offset) pairs, typecum chunk or None) for the whole epoch."""
    P, R = stream.packed_length, stream.rows_per_epoch
    T = len(stream.types)
    lut = np.full(max(stream.types) + 1, -1, dtype=np.int64)
    lut[stream.types] = np.arange(T)
    pos = base = 0
    carry = np.zeros(T, dtype=np.int64)
    n_cum = 0
    for ids, lens in stream.order_chunks(epoch):
        for a in range(0, len(ids), SUB):
            g, L = ids[a:a + SUB], lens[a:a + SUB]
            ends = pos + np.cumsum(L)
            end = int(ends[-1]) if len(ends) else pos
            k0 = -(-pos // P)
            ks = np.arange(k0, max(k0, min(-(-end // P), R)), dtype=np.int64)
            jj = np.searchsorted(ends, ks * P, side="right")
            rows = np.empty(2 * len(ks), dtype=np.int64)
            rows[0::2] = base + jj
            rows[1::2] = ks * P - (ends[jj] - L[jj])
            cum = None
            if stream.with_types:
                kc = np.arange(k0, max(k0, min(-(-end // P), R + 1)), dtype=np.int64)
                jc = np.searchsorted(ends, kc * P, side="right")
                ty = lut[stream.table.types_of(g)]
                cum = np.empty((len(kc), T), dtype=np.int64)
                for t in range(T):
                    ct = carry[t] + np.cumsum(np.where(ty == t, L, 0))
                    cum[:, t] = ct[jc] - (ends[jc] - kc * P) * (ty[jc] == t)
                    carry[t] = ct[-1] if len(ct) else carry[t]
                n_cum += len(kc)
            yield g, rows, (cum.reshape(-1) if cum is not None else None)
            pos, base = end, base + len(g)
    if stream.with_types and n_cum == R:  # the last row ends exactly at the end of the epoch
        yield np.zeros(0, np.int64), np.zeros(0, np.int64), carry.copy()


def build_epoch_in_memory(stream: Stream, epoch: int) -> EpochIndex:
    orders, rows, cums = [], [], []
    for g, r, c in _epoch_parts(stream, epoch):
        orders.append(g)
        rows.append(r)
        if c is not None:
            cums.append(c)
    order = np.concatenate(orders) if orders else np.zeros(0, np.int64)
    return EpochIndex(order, np.concatenate(rows), np.concatenate(cums) if stream.with_types else None,
                      stream.rows_per_epoch, stream.num_tokens, stream.types)


def build_epoch_files(stream: Stream, epoch: int, folder: str) -> None:
    t0 = time.perf_counter()
    dtype = "<i4" if stream.table.num_docs < 2**31 else "<i8"
    R, T = stream.rows_per_epoch, len(stream.types)
    order = NpyWriter(os.path.join(folder, "order.npy"), dtype, stream.num_docs)
    rows = NpyWriter(os.path.join(folder, "rows.npy"), "<i8", 2 * R)
    cum = NpyWriter(os.path.join(folder, "typecum.npy"), "<i8", (R + 1) * T) if stream.with_types else None
    for g, r, c in _epoch_parts(stream, epoch):
        order.write(g)
        rows.write(r)
        if cum is not None:
            cum.write(c)
    for w in (order, rows, cum):
        if w is not None:
            w.close()
    _write_json(os.path.join(folder, "epoch.json"), {"num_rows": R, "total": stream.num_tokens,
                                                     "types": stream.types, "epoch": epoch})
    logger.info("index cache: epoch %d of %d documents, %d rows built in %.2f s", epoch, stream.num_docs, R,
                time.perf_counter() - t0)


class EpochSource:
    """The epochs of one stream, built on demand (in the cache folder, or in memory without one)."""

    def __init__(self, stream: Stream, cache_folder: Optional[str]):
        self.stream = stream
        self.folder = os.path.join(cache_folder, _key(stream.key())) if cache_folder else None
        self._open: dict[int, EpochIndex] = {}
        self._lock = threading.Lock()
        self._ahead: Optional[threading.Thread] = None

    def epoch(self, e: int) -> EpochIndex:
        with self._lock:
            ep = self._open.get(e)
            if ep is None:
                if self.folder is None:
                    ep = build_epoch_in_memory(self.stream, e)
                else:
                    final = os.path.join(self.folder, f"epoch-{e}")
                    _build_once(final, lambda tmp: build_epoch_files(self.stream, e, tmp))
                    ep = EpochIndex.open(final)
                    self._prebuild(e + 1)
                self._open = {k: v for k, v in self._open.items() if k >= e - 1}
                self._open[e] = ep
            return ep

    def _prebuild(self, e: int) -> None:
        """Build epoch e in a background thread while epoch e - 1 trains (no pause at the epoch boundary)."""
        final = os.path.join(self.folder, f"epoch-{e}")
        if os.path.isdir(final) or (self._ahead is not None and self._ahead.is_alive()):
            return

        def run():
            try:
                _build_once(final, lambda tmp: build_epoch_files(self.stream, e, tmp))
            except Exception as err:  # noqa: BLE001 - the training thread builds it again and raises
                logger.warning("index cache: building epoch %d ahead failed (%s); it is built when reached", e, err)

        self._ahead = threading.Thread(target=run, name="internlm_core-index", daemon=True)
        self._ahead.start()


def rows_of(stream: Stream, what: str) -> int:
    if stream.rows_per_epoch < 1:
        raise DataError(f"{what} has {stream.num_tokens} tokens, fewer than one packed row of "
                        f"{stream.packed_length} tokens (data.seq_len * data.micro_bsz)")
    return stream.rows_per_epoch


__all__ = ["EpochIndex", "EpochSource", "FileArray", "Stream", "default_cache_root", "rows_of", "scan_table"]
