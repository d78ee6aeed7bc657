"""Megatron's indexed dataset (``MMIDIDX``): ``X.bin`` (raw token ids) with ``X.idx``, as GPT-NeoX, NeMo and
Megatron-LM's ``tools/preprocess_data.py`` write it.

``X.idx``, little-endian::

    magic b"MMIDIDX\\x00\\x00" (9) | version u64 (1) | dtype code u8 | sequence_count u64 | document_count u64
    sequence_lengths   int32[sequence_count]    tokens of each sequence
    sequence_pointers  int64[sequence_count]    byte offset of each sequence in X.bin
    document_indices   int64[document_count]    sequence index where each document starts (0 ... sequence_count)
    sequence_modes     int8[sequence_count]     only in multimodal files (ignored here)

dtype codes (megatron.core.datasets.indexed_dataset.DType): 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
6 float64, 7 float32, 8 uint16. ``X.bin`` has no header: sequence i is ``sequence_lengths[i]`` ids of that dtype at
byte ``sequence_pointers[i]``.

As Megatron's GPTDataset does, every sequence is trained as one document (for GPT data written with one sequence
per document, as preprocess_data.py does without --split-sentences, sequences and documents are the same).
The writer here follows the layout above; tests also check this reader against files written by megatron-core's
own `IndexedDatasetBuilder`.
"""

from __future__ import annotations

import os
import struct
from typing import Optional

import numpy as np

from internlm_core.errors import DataError

from .tokenfile import CHUNK, VERIFY_MAX_BYTES, FileArray, FileReader, TokenFile, head_tail_digest, stat_key

MAGIC = b"MMIDIDX\x00\x00"
_HEAD = struct.Struct("<9sQBQQ")  # 34 bytes
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
CODES = {np.dtype(v).str.lstrip("<>|="): k for k, v in DTYPES.items()}  # "u2" -> 8


def idx_path_for(bin_path: str) -> str:
    """``X.bin`` → ``X.idx``."""
    return (bin_path[:-4] if bin_path.endswith(".bin") else bin_path) + ".idx"


class MegatronTokenFile(TokenFile):
    format = "megatron"

    def __init__(self, path: str, idx_path: str, verify: Optional[bool] = None):
        self.path, self.idx_path = path, idx_path
        isize = os.path.getsize(idx_path)
        with open(idx_path, "rb") as fh:
            head = fh.read(_HEAD.size)
        if len(head) < _HEAD.size:
            raise DataError(f"{idx_path}: truncated .idx: {isize} bytes, shorter than the {_HEAD.size}-byte header")
        magic, version, code, nseq, ndoc = _HEAD.unpack(head)
        if magic != MAGIC:
            raise DataError(f"{idx_path}: not a Megatron index: bad magic {magic!r} (expected {MAGIC!r})")
        if version != 1:
            raise DataError(f"{idx_path}: Megatron index version {version} is not supported (this reader knows 1)")
        if code not in DTYPES:
            raise DataError(f"{idx_path}: corrupted .idx header: unknown dtype code {code} (Megatron's codes are 1-8)")
        self.dtype = np.dtype(DTYPES[code]).newbyteorder("<")
        if self.dtype.kind == "f":
            raise DataError(f"{idx_path}: dtype code {code} ({self.dtype.name}) holds no token ids")
        base = _HEAD.size + 12 * nseq + 8 * ndoc
        if isize not in (base, base + nseq):  # + nseq: the modes of a multimodal file
            raise DataError(f"{idx_path}: {'truncated' if isize < base else 'corrupted'} .idx: {isize} bytes, "
                            f"expected {base} for {nseq} sequences and {ndoc} document indices")
        self.num_docs, self.document_count = int(nseq), max(0, int(ndoc) - 1)
        off = _HEAD.size
        self._lengths = FileArray(idx_path, off, "<i4", nseq, block=512, cache_blocks=4)
        self._pointers = FileArray(idx_path, off + 4 * nseq, "<i8", nseq, block=512, cache_blocks=4)
        self._documents = FileArray(idx_path, off + 12 * nseq, "<i8", ndoc, block=512, cache_blocks=2)
        self._bin = FileReader(path)
        size = os.path.getsize(path)
        item = self.dtype.itemsize
        expected = int(self._pointers[nseq - 1]) + int(self._lengths[nseq - 1]) * item if nseq else 0
        if size != expected:
            raise DataError(f"{path}: {'truncated' if size < expected else 'corrupted'} Megatron .bin: {size} bytes, "
                            f"its {os.path.basename(idx_path)} promises {expected}")
        if ndoc and (int(self._documents[0]) != 0 or int(self._documents[ndoc - 1]) != nseq):
            raise DataError(f"{idx_path}: corrupted .idx: document indices do not run from 0 to {nseq}")
        if verify or (verify is None and size <= VERIFY_MAX_BYTES):
            self.check()

    def check(self) -> None:
        """Lengths >= 0, each pointer right after the previous sequence, document indices increasing."""
        item = self.dtype.itemsize
        expect = 0
        for s, lengths in self._lengths.chunks(CHUNK):
            ptr = self._pointers.read(s, s + len(lengths))
            want = expect + np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64) * item)])
            if lengths.min(initial=0) < 0 or not np.array_equal(ptr, want):
                bad = int(np.nonzero((ptr != want) | (lengths < 0))[0][0]) + s
                raise DataError(f"{self.idx_path}: corrupted .idx: sequence {bad} has pointer {int(self._pointers[bad])} "
                                f"and length {int(self._lengths[bad])}, not right after the previous sequence")
            expect = int(want[-1]) + int(lengths[-1]) * item
        prev = -1
        for _, d in self._documents.chunks(CHUNK):
            if (len(d) and int(d[0]) < prev) or np.any(np.diff(d) < 0):
                raise DataError(f"{self.idx_path}: corrupted .idx: document indices are not increasing")
            prev = int(d[-1]) if len(d) else prev

    def read_lengths(self, start: int, stop: int) -> np.ndarray:
        return self._lengths.read(start, stop).astype(np.int64)

    def length(self, i: int) -> int:
        return int(self._lengths[i])

    def _tokens(self, i: int, start: int, stop: Optional[int]) -> np.ndarray:
        n_doc = int(self._lengths[i])
        stop = n_doc if stop is None else min(stop, n_doc)
        n = max(0, stop - start)
        item = self.dtype.itemsize
        raw = self._bin.pread(n * item, int(self._pointers[i]) + start * item)
        if len(raw) != n * item:
            raise DataError(f"{self.path}: truncated Megatron .bin: sequence {i} lies past the end of the file")
        return np.frombuffer(raw, dtype=self.dtype)

    def read(self, i: int, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        return self._tokens(i, start, stop).astype(np.int64)

    def read_into(self, out: np.ndarray, i: int, start: int, stop: int) -> None:
        out[:] = self._tokens(i, start, stop)

    def fingerprint(self) -> dict:
        return {"format": self.format, "bin": stat_key(self.path), "idx": stat_key(self.idx_path),
                "idx_digest": head_tail_digest(self.idx_path)}

    def doc_location(self, i: int) -> str:
        return f"{self.path}: sequence {i}"


class MegatronWriter:
    """Writes ``X.bin`` + ``X.idx`` (one sequence per document), the layout in this module's docstring.

    Ids fit uint16 up to a vocabulary of 65536, int32 beyond (signed data: int16/int32/int64).
    """

    def __init__(self, bin_path: str, idx_path: Optional[str] = None, vocab_size: int = 65536, signed: bool = False):
        self.bin_path = bin_path
        self.idx_path = idx_path or idx_path_for(bin_path)
        self.vocab_size = vocab_size
        if signed:
            self.dtype = np.dtype("<i2" if vocab_size <= 2**15 else "<i4" if vocab_size <= 2**31 else "<i8")
        else:
            self.dtype = np.dtype("<u2" if vocab_size <= 2**16 else "<i4" if vocab_size <= 2**31 else "<i8")
        self.signed = signed
        self._fh = open(bin_path, "wb")
        self._lengths: list[int] = []
        self.num_tokens = 0

    def write(self, ids) -> None:
        self.write_many(np.asarray(ids, dtype=np.int64), [len(ids)])

    def write_many(self, flat, lengths) -> None:
        flat = np.asarray(flat, dtype=np.int64)
        if len(flat):
            lo, hi = int(flat.min()), int(flat.max())
            if hi >= self.vocab_size or (lo < 0 and not self.signed) or lo <= -self.vocab_size:
                bad = hi if hi >= self.vocab_size else lo
                raise DataError(f"{self.bin_path}: token id {bad} does not fit the vocabulary of {self.vocab_size} ids")
        self._fh.write(flat.astype(self.dtype).tobytes())
        self._lengths.extend(int(x) for x in lengths)
        self.num_tokens += int(len(flat))

    def close(self) -> None:
        self._fh.close()
        lengths = np.asarray(self._lengths, dtype="<i4")
        pointers = np.zeros(len(lengths), dtype="<i8")
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        docs = np.arange(len(lengths) + 1, dtype="<i8")
        with open(self.idx_path, "wb") as fh:
            fh.write(_HEAD.pack(MAGIC, 1, CODES[self.dtype.str.lstrip("<>|=")], len(lengths), len(docs)))
            fh.write(lengths.tobytes())
            fh.write(pointers.tobytes())
            fh.write(docs.tobytes())
