"""InternLM's token format: one ``{"tokens": [...]}`` JSON line per document in ``X.bin``, and ``X.bin.meta``, the
``np.save`` of an integer array of shape (N, 2) with rows (byte offset of the line, number of tokens).

Both are read by `pread`: the meta's rows a reader needs, the line of a document when it is read.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Optional

import numpy as np

from internlm_core.errors import DataError

from .tokenfile import CHUNK, VERIFY_MAX_BYTES, FileArray, FileReader, TokenFile, head_tail_digest, npy_layout, stat_key

INTERNLM_PREFIX = b'{"tokens": ['


class InternLMTokenFile(TokenFile):
    format = "internlm"

    def __init__(self, path: str, meta_path: str, verify: Optional[bool] = None):
        self.path, self.meta_path = path, meta_path
        self.size = size = os.path.getsize(path)
        if not os.path.exists(meta_path):
            raise DataError(f"{meta_path}: missing (every .bin needs its .bin.meta index)")
        try:
            dtype, shape, fortran, offset = npy_layout(meta_path)
        except DataError as e:
            raise DataError(f"{meta_path}: corrupted or truncated .bin.meta ({str(e).split(': ', 1)[1]})") from None
        if len(shape) != 2 or shape[1] != 2 or dtype.kind not in "iu":
            raise DataError(f"{meta_path}: corrupted .bin.meta: expected an integer array of shape (N, 2), "
                            f"got {dtype} {shape}")
        n = shape[0]
        if os.path.getsize(meta_path) != offset + 2 * n * dtype.itemsize:
            raise DataError(f"{meta_path}: corrupted or truncated .bin.meta (not a readable .npy array: "
                            f"{os.path.getsize(meta_path)} bytes, its header promises {offset + 2 * n * dtype.itemsize})")
        if n == 0:
            raise DataError(f"{meta_path}: empty .bin.meta (no documents)")
        self.num_docs, self._fortran = n, fortran
        self._meta = FileArray(meta_path, offset, dtype, 2 * n, block=512, cache_blocks=4)
        self._bin = FileReader(path)
        if self._bin.pread(1, size - 1) != b"\n":
            raise DataError(f"{path}: truncated InternLM .bin: the last line has no newline")
        first, last = self._row(0), self._row(n - 1)
        if first[0] != 0 or last[0] >= size:
            self._mismatch()
        if verify or (verify is None and size <= VERIFY_MAX_BYTES):
            self.check()
        # the first and last lines are parsed now, so that a mismatched pair is noticed at open time
        self._parse(0)
        self._parse(n - 1)

    def _mismatch(self):
        raise DataError(f"{self.meta_path}: does not match {self.path}: offsets must increase from 0 and stay below "
                        f"the bin's {self.size} bytes, lengths must be >= 0")

    def _row(self, i: int) -> tuple[int, int]:
        if self._fortran:
            return int(self._meta[i]), int(self._meta[self.num_docs + i])
        r = self._meta[2 * i: 2 * i + 2]
        return int(r[0]), int(r[1])

    def _columns(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        stop = min(stop, self.num_docs)
        if self._fortran:
            return (self._meta.read(start, stop).astype(np.int64),
                    self._meta.read(self.num_docs + start, self.num_docs + stop).astype(np.int64))
        flat = self._meta.read(2 * start, 2 * stop).astype(np.int64)
        return flat[0::2], flat[1::2]

    def read_lengths(self, start: int, stop: int) -> np.ndarray:
        return self._columns(start, stop)[1]

    def length(self, i: int) -> int:
        return self._row(i)[1]

    def check(self) -> None:
        """Offsets increasing inside the bin, lengths >= 0, every entry at the start of a line (all entries of a
        file up to VERIFY_MAX_BYTES, 100,000 of them spread over a bigger one). Memory stays bounded."""
        prev = -1
        for s in range(0, self.num_docs, CHUNK):
            starts, lengths = self._columns(s, s + CHUNK)
            if starts[0] <= prev or np.any(np.diff(starts) <= 0) or starts[-1] >= self.size or np.any(lengths < 0):
                self._mismatch()
            prev = int(starts[-1])
        if self.size <= VERIFY_MAX_BYTES:  # every entry: the file is read once, 16 MB at a time
            for s in range(0, self.num_docs, CHUNK):
                pos = self._columns(s, s + CHUNK)[0] - 1
                first = 1 if s == 0 else 0
                for a in range(int(pos[first]) if len(pos) > first else 0, int(pos[-1]) + 1, 1 << 24):
                    sel = np.nonzero((pos >= a) & (pos < a + (1 << 24)))[0]
                    sel = sel[sel >= first]
                    if not len(sel):
                        continue
                    data = np.frombuffer(self._bin.pread(1 << 24, a), dtype=np.uint8)
                    bad = sel[data[pos[sel] - a] != 0x0A]
                    if len(bad):
                        self._not_line_start(s + int(bad[0]))
        else:  # 100,000 entries spread over the file, one read each
            for j in np.unique(np.linspace(1, self.num_docs - 1, 100_000).astype(np.int64)).tolist():
                if self._bin.pread(1, self._row(j)[0] - 1) != b"\n":
                    self._not_line_start(j)

    def _not_line_start(self, j: int):
        raise DataError(f"{self.meta_path}: does not match {self.path}: entry {j} points to byte "
                        f"{self._row(j)[0]}, which does not start a line")

    def doc_location(self, i: int) -> str:
        return f"{self.path}: line {i + 1}"

    def _parse(self, i: int) -> np.ndarray:
        start, length = self._row(i)
        end = self._row(i + 1)[0] if i + 1 < self.num_docs else self.size
        raw = self._bin.pread(end - start, start)
        toks = None
        if raw.startswith(INTERNLM_PREFIX) and raw.endswith(b"]}\n"):
            body = raw[len(INTERNLM_PREFIX):-3]
            if body.strip():
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        toks = np.fromstring(body, dtype=np.int64, sep=",")  # 4-5x faster than json.loads
                except ValueError:
                    toks = None
            else:
                toks = np.zeros(0, dtype=np.int64)
        if toks is None:
            try:
                rec = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                raise DataError(f"{self.path}: line {i + 1}: corrupted: not valid JSON ({e})") from None
            t = rec.get("tokens") if isinstance(rec, dict) else None
            if not isinstance(t, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in t):
                raise DataError(f"{self.path}: line {i + 1}: corrupted: expected {{\"tokens\": [int, ...]}}")
            try:
                toks = np.asarray(t, dtype=np.int64)
            except OverflowError:
                raise DataError(f"{self.path}: line {i + 1}: corrupted: a token id does not fit in 64 bits") from None
        if len(toks) != length:
            raise DataError(f"{self.path}: line {i + 1}: has {len(toks)} tokens, but {self.path}.meta says "
                            f"{length} (meta does not match bin)")
        return toks

    def read(self, i: int, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        return self._parse(i)[start:stop]

    def fingerprint(self) -> dict:
        return {"format": self.format, "bin": stat_key(self.path), "meta": stat_key(self.meta_path),
                "meta_digest": head_tail_digest(self.meta_path)}


class InternLMWriter:
    """Streams documents in InternLM's format: `{"tokens": [...]}` lines and an np.save'd int32 (N, 2) meta."""

    def __init__(self, bin_path: str, meta_path: str, vocab_size: int = 0, signed: bool = False):
        self.bin_path, self.meta_path = bin_path, meta_path
        self._fh = open(bin_path, "wb")
        self._meta: list[tuple[int, int]] = []
        self._pos = 0
        self.num_tokens = 0

    def write(self, ids) -> None:
        ids = [int(x) for x in ids]
        line = (json.dumps({"tokens": ids}) + "\n").encode()
        self._fh.write(line)
        self._meta.append((self._pos, len(ids)))
        self._pos += len(line)
        self.num_tokens += len(ids)

    def write_many(self, flat: np.ndarray, lengths) -> None:
        pos = 0
        flat = np.asarray(flat).tolist()
        for n in lengths:
            self.write(flat[pos: pos + n])
            pos += n

    def close(self) -> None:
        self._fh.close()
        with open(self.meta_path, "wb") as fh:
            np.save(fh, np.array(self._meta, dtype=np.int32).reshape(-1, 2))
