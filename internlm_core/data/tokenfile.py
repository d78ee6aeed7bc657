"""What every tokenized file offers, and arrays on disk read by `pread` (no memory map, nothing resident).

The training loader touches a few documents per row out of corpora of billions of documents. Memory-mapping the
per-document indices would make every page it ever touched part of each rank's resident memory; reading the few
entries it needs with `os.pread` keeps a rank's memory independent of the corpus size (the kernel's page cache still
serves repeated reads).
"""

from __future__ import annotations

import os
from typing import Iterator, Optional

import numpy as np

from internlm_core.errors import DataError

CHUNK = 1 << 18  # entries read at once by the sequential passes (2 MB of int64)
VERIFY_MAX_BYTES = 1 << 30  # open_token_file(verify=None) checks files up to this size


class FileReader:
    """A file descriptor per process, read with pread."""

    def __init__(self, path: str):
        self.path = path
        self._fd: Optional[int] = None
        self._pid = -1

    def pread(self, n: int, offset: int) -> bytes:
        if self._fd is None or self._pid != os.getpid():
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        return os.pread(self._fd, n, offset)

    def __getstate__(self):
        return {"path": self.path, "_fd": None, "_pid": -1}


class FileArray:
    """A 1-D array of `dtype` stored at byte `offset` of `path`, read by `pread` through a small block cache.

    `block` entries are read at a time (sequential readers want large blocks, random readers small ones); the cache
    holds at most `cache_blocks` blocks (it is emptied when full), so memory stays bounded whatever the length.
    """

    def __init__(self, path: str, offset: int, dtype, length: int, block: int = 512, cache_blocks: int = 8):
        self.path, self.offset, self.dtype, self.length = path, int(offset), np.dtype(dtype), int(length)
        self.block, self.cache_blocks = int(block), int(cache_blocks)
        self._fd: Optional[int] = None
        self._pid = -1
        self._cache: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.length

    def _file(self) -> int:
        if self._fd is None or self._pid != os.getpid():  # a forked worker opens its own descriptor
            self._fd = os.open(self.path, os.O_RDONLY)
            self._pid = os.getpid()
        return self._fd

    def read(self, start: int, stop: int) -> np.ndarray:
        """Entries [start, stop) read straight from the file (a new array; no caching)."""
        start, stop = max(0, int(start)), min(self.length, int(stop))
        if stop <= start:
            return np.zeros(0, self.dtype)
        n = (stop - start) * self.dtype.itemsize
        raw = os.pread(self._file(), n, self.offset + start * self.dtype.itemsize)
        if len(raw) != n:
            raise DataError(f"{self.path}: truncated: entries {start}..{stop} lie past the end of the file")
        return np.frombuffer(raw, dtype=self.dtype)

    def _block(self, b: int) -> np.ndarray:
        arr = self._cache.get(b)
        if arr is None:
            arr = self.read(b * self.block, (b + 1) * self.block)
            if len(self._cache) >= self.cache_blocks:
                self._cache.clear()  # bounded; a plain dict needs no lock across the loader's threads
            self._cache[b] = arr
        return arr

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self.length)
            if step != 1:
                raise IndexError("FileArray slices take no step")
            if stop - start > self.block:
                return self.read(start, stop)
            b0, b1 = start // self.block, (stop - 1) // self.block if stop > start else start // self.block
            if b0 == b1:
                return self._block(b0)[start - b0 * self.block: stop - b0 * self.block]
            return np.concatenate([self._block(b) for b in range(b0, b1 + 1)])[start - b0 * self.block:
                                                                                 stop - b0 * self.block]
        i = int(i)
        if i < 0:
            i += self.length
        if not 0 <= i < self.length:
            raise IndexError(f"{self.path}: index {i} out of range for {self.length} entries")
        b = i // self.block
        return self._block(b)[i - b * self.block]

    def pair(self, i: int) -> tuple[int, int]:
        """Entries i and i + 1 (an offset table's start and end of item i)."""
        b = i // self.block
        arr, k = self._block(b), i - b * self.block
        if k + 1 < len(arr):
            return int(arr[k]), int(arr[k + 1])
        return int(arr[k]), int(self._block(b + 1)[0])

    def chunks(self, chunk: int = CHUNK) -> Iterator[tuple[int, np.ndarray]]:
        """(start, entries) of consecutive chunks, read without caching (for one pass over the whole array)."""
        for s in range(0, self.length, chunk):
            yield s, self.read(s, s + chunk)

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(_fd=None, _pid=-1, _cache={})
        return state


def npy_layout(path: str) -> tuple[np.dtype, tuple, bool, int]:
    """(dtype, shape, fortran_order, data offset) of an `.npy` file, from its header only."""
    try:
        with open(path, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
            return np.dtype(dtype), tuple(shape), bool(fortran), fh.tell()
    except Exception as e:  # numpy raises ValueError/EOFError/OSError for broken headers
        raise DataError(f"{path}: not a readable .npy array ({e})") from None


def npy_array(path: str, block: int = 8192, cache_blocks: int = 4) -> FileArray:
    """A 1-D `.npy` file (as written by `NpyWriter`) as a `FileArray`."""
    dtype, shape, _, offset = npy_layout(path)
    if len(shape) != 1:
        raise DataError(f"{path}: expected a 1-D array, got shape {shape}")
    expected = offset + shape[0] * dtype.itemsize
    if os.path.getsize(path) != expected:
        raise DataError(f"{path}: truncated: {os.path.getsize(path)} bytes, its header promises {expected}")
    return FileArray(path, offset, dtype, shape[0], block, cache_blocks)


class NpyWriter:
    """Writes a 1-D `.npy` file of known length chunk by chunk with plain writes (no array held in memory)."""

    def __init__(self, path: str, dtype, length: int):
        self.path, self.dtype, self.length = path, np.dtype(dtype), int(length)
        self._fh = open(path, "wb")
        np.lib.format.write_array_header_2_0(self._fh, {"descr": np.lib.format.dtype_to_descr(self.dtype),
                                                       "fortran_order": False, "shape": (self.length,)})
        self.written = 0

    def write(self, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, dtype=self.dtype)
        self._fh.write(arr.tobytes())
        self.written += len(arr)

    def close(self) -> None:
        self._fh.close()
        if self.written != self.length:
            raise DataError(f"{self.path}: wrote {self.written} entries, expected {self.length}")


class TokenFile:
    """One tokenized file: `num_docs`, `length(i)`, `read(i, start, stop)` → int64 token ids.

    The per-document index stays on disk: `read_lengths(a, b)` reads the lengths of documents [a, b) (one pass
    over a corpus reads them chunk by chunk), `lengths` reads all of them (tests and tools only).
    """

    format: str = ""
    path: str
    vocab_size: Optional[int] = None
    num_docs: int = 0

    def read_lengths(self, start: int, stop: int) -> np.ndarray:
        raise NotImplementedError

    def length(self, i: int) -> int:
        return int(self.read_lengths(i, i + 1)[0])

    @property
    def lengths(self) -> np.ndarray:
        return np.concatenate([np.zeros(0, np.int64)] + [self.read_lengths(s, s + CHUNK).astype(np.int64)
                                                          for s in range(0, self.num_docs, CHUNK)])

    @property
    def num_tokens(self) -> int:
        return int(sum(int(self.read_lengths(s, s + CHUNK).sum()) for s in range(0, self.num_docs, CHUNK)))

    def read(self, i: int, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        raise NotImplementedError

    def read_into(self, out: np.ndarray, i: int, start: int, stop: int) -> None:
        """Copy tokens ``[start, stop)`` of document i into `out` (len(out) == stop - start)."""
        out[:] = self.read(i, start, stop)

    def check(self) -> None:
        """Check the whole index (and, where the format allows, the data) once; DataError naming what is wrong."""

    def fingerprint(self) -> dict:
        """What identifies this file's index: a changed file gets another fingerprint."""
        raise NotImplementedError

    def doc_location(self, i: int) -> str:
        """How a user finds document i in this file (for error messages)."""
        return f"{self.path}: document {i}"


def stat_key(path: str) -> list:
    st = os.stat(path)
    return [int(st.st_size), int(st.st_mtime_ns)]


def head_tail_digest(path: str, span: int = 1 << 16) -> str:
    """A digest of the first and last `span` bytes of a file (cheap, catches a rewritten index)."""
    import hashlib

    h = hashlib.sha1()
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        h.update(fh.read(span))
        if size > span:
            fh.seek(max(span, size - span))
            h.update(fh.read(span))
    return h.hexdigest()
