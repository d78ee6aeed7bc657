"""On-disk token formats: ours (compact binary), InternLM's (JSON lines) and Megatron's (`.bin` + `.idx`, see
megatron.py), all read by `pread` so that no per-document index is held in memory.

Our format ("ILMC", version 1), little-endian:

``X.bin``       64-byte header, then the token ids of every document back to back as fixed-width integers.
                header: magic ``b"\\x93ILMCBIN"`` (8) | version u16 | itemsize u8 (2, 4 or 8) | signed u8 |
                reserved u32 | vocab_size u64 | num_tokens u64 | num_docs u64 | file_id 16 bytes | reserved 8.
                The width is the smallest that holds the vocabulary: uint16 up to 65536 ids, int32 beyond, and a
                signed type when the data holds negative ids (InternLM's SFT masking: "input, but no loss").
``X.bin.meta``  64-byte header, then ``num_docs + 1`` int64 token offsets (``offsets[0] == 0``,
                ``offsets[-1] == num_tokens``; document i is ``tokens[offsets[i]:offsets[i+1]]``).
                header: magic ``b"\\x93ILMCIDX"`` (8) | version u16 | reserved 6 | num_docs u64 | num_tokens u64 |
                file_id 16 bytes (equal to the bin's: a meta that belongs to another bin is detected) |
                crc32 u32 of the bin's token bytes | flags u32 (1: crc32 is set) | reserved 8.

InternLM's format (``--format internlm``): ``X.bin`` holds one line per document, the UTF-8 bytes of
``json.dumps({"tokens": [...]}) + "\\n"``; ``X.bin.meta`` is ``np.save`` of an int32 array of shape (N, 2), rows
(byte offset of the line, number of tokens).

`open_token_file(path)` detects the format (our header, a JSON line with its `.bin.meta`, or a Megatron `.idx`
beside the bin) and returns a `TokenFile`. Opening checks the headers and the ends of the index; `check()` reads the
whole index (and our checksum). `open_token_file(verify=None)` runs it for files of at most VERIFY_MAX_BYTES; the
training loader runs it once per corpus version, when it builds its index cache (see index.py), and
``python -m internlm_core.data.verify PATH...`` runs it for any size. Every inconsistency raises `DataError`
naming the file, and for InternLM files the line number.
"""

from __future__ import annotations

import os
import struct
import uuid
import zlib
from typing import Optional

import numpy as np

from internlm_core.errors import DataError

from .megatron import MegatronTokenFile, MegatronWriter, idx_path_for
from .internlm_format import INTERNLM_PREFIX, InternLMTokenFile, InternLMWriter  # noqa: F401 - re-exported
from .tokenfile import CHUNK, VERIFY_MAX_BYTES, FileArray, FileReader, TokenFile, stat_key

BIN_MAGIC = b"\x93ILMCBIN"
META_MAGIC = b"\x93ILMCIDX"
VERSION = 1
HEADER_SIZE = 64
_BIN_HEADER = struct.Struct("<8sHBBIQQQ16s8x")   # 64 bytes
_META_HEADER = struct.Struct("<8sH6xQQ16sII8x")  # 64 bytes
HAS_CRC = 1
_READ = 1 << 22  # bytes read at once by the checksum
assert _BIN_HEADER.size == HEADER_SIZE and _META_HEADER.size == HEADER_SIZE  # layout constants, not user input


def dtype_for(vocab_size: int, signed: bool = False) -> np.dtype:
    """The narrowest integer type that holds ids in [0, vocab_size) (and their negatives if `signed`)."""
    if signed:
        if vocab_size <= 2**15:
            return np.dtype("<i2")
        if vocab_size <= 2**31:
            return np.dtype("<i4")
        return np.dtype("<i8")
    if vocab_size <= 2**16:
        return np.dtype("<u2")
    if vocab_size <= 2**31:
        return np.dtype("<i4")
    return np.dtype("<i8")


def _np_dtype(itemsize: int, signed: bool) -> Optional[np.dtype]:
    table = {(2, False): "<u2", (2, True): "<i2", (4, False): "<u4", (4, True): "<i4", (8, True): "<i8", (8, False): "<u8"}
    code = table.get((itemsize, signed))
    return np.dtype(code) if code else None


class OursTokenFile(TokenFile):
    format = "ours"

    def __init__(self, path: str, meta_path: str, verify: Optional[bool] = None):
        self.path, self.meta_path = path, meta_path
        size = os.path.getsize(path)
        if size < HEADER_SIZE:
            raise DataError(f"{path}: truncated .bin: {size} bytes, shorter than the {HEADER_SIZE}-byte header")
        with open(path, "rb") as fh:
            head = fh.read(HEADER_SIZE)
        magic, version, itemsize, signed, _, vocab, ntok, ndocs, fid = _BIN_HEADER.unpack(head)
        if magic != BIN_MAGIC:
            raise DataError(f"{path}: corrupted .bin header: bad magic {magic!r}")
        if version != VERSION:
            raise DataError(f"{path}: .bin format version {version} is not supported (this reader knows {VERSION})")
        dtype = _np_dtype(itemsize, bool(signed))
        if dtype is None or signed not in (0, 1):
            raise DataError(f"{path}: corrupted .bin header: token width {itemsize} bytes, signed={signed}")
        expected = HEADER_SIZE + ntok * itemsize
        if size < expected:
            raise DataError(f"{path}: truncated .bin: {size} bytes, the header promises {expected} "
                            f"({ntok} tokens of {itemsize} bytes)")
        if size > expected:
            raise DataError(f"{path}: corrupted .bin: {size} bytes, the header promises {expected} "
                            f"({size - expected} trailing bytes)")
        self.vocab_size, self.dtype, self.file_id = int(vocab), dtype, fid
        self.num_docs, self._num_tokens = int(ndocs), int(ntok)
        if not os.path.exists(meta_path):
            raise DataError(f"{meta_path}: missing (every .bin needs its .bin.meta index)")
        msize = os.path.getsize(meta_path)
        if msize < HEADER_SIZE:
            raise DataError(f"{meta_path}: truncated .bin.meta: {msize} bytes, shorter than the {HEADER_SIZE}-byte header")
        with open(meta_path, "rb") as fh:
            mhead = fh.read(HEADER_SIZE)
        mmagic, mversion, mdocs, mtok, mfid, crc, flags = _META_HEADER.unpack(mhead)
        if mmagic != META_MAGIC:
            raise DataError(f"{meta_path}: corrupted .bin.meta header: bad magic {mmagic!r}")
        if mversion != VERSION:
            raise DataError(f"{meta_path}: .bin.meta format version {mversion} is not supported")
        if mfid != fid or mdocs != ndocs or mtok != ntok:
            raise DataError(f"{meta_path}: does not match {path} (meta: {mdocs} documents, {mtok} tokens; "
                            f"bin: {ndocs} documents, {ntok} tokens; same file id: {mfid == fid})")
        mexpected = HEADER_SIZE + 8 * (ndocs + 1)
        if msize != mexpected:
            raise DataError(f"{meta_path}: {'truncated' if msize < mexpected else 'corrupted'} .bin.meta: {msize} bytes, "
                            f"expected {mexpected} for {ndocs} documents")
        self.offsets = FileArray(meta_path, HEADER_SIZE, "<i8", ndocs + 1, block=512, cache_blocks=4)
        if int(self.offsets[0]) != 0 or int(self.offsets[ndocs]) != ntok:
            self._bad_offsets()
        self.crc = crc if flags & HAS_CRC else None
        self._bin = FileReader(path)
        if verify or (verify is None and ntok * itemsize <= VERIFY_MAX_BYTES):
            self.check()

    def _bad_offsets(self):
        raise DataError(f"{self.meta_path}: corrupted .bin.meta: document offsets are not increasing from 0 to "
                        f"{self._num_tokens}")

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def check(self) -> None:
        """Offsets increasing from 0 to num_tokens, and the token bytes against the meta's CRC32."""
        for s, o in self.offsets.chunks(CHUNK):
            if len(o) > 1 and np.any(np.diff(o) < 0):
                self._bad_offsets()
            if s and len(o):  # the chunk boundary
                if int(self.offsets[s - 1]) > int(o[0]):
                    self._bad_offsets()
        self.verify()

    def verify(self) -> None:
        """Check the token bytes against the CRC32 recorded in the meta (DataError on a mismatch)."""
        if self.crc is None:
            return
        crc = 0
        with open(self.path, "rb") as fh:
            fh.seek(HEADER_SIZE)
            while True:
                buf = fh.read(_READ)
                if not buf:
                    break
                crc = zlib.crc32(buf, crc)
        if crc != self.crc:
            raise DataError(f"{self.path}: corrupted .bin: the token data does not match the checksum in its "
                            f".bin.meta (crc32 {crc:08x}, expected {self.crc:08x})")

    def read_lengths(self, start: int, stop: int) -> np.ndarray:
        o = self.offsets.read(start, min(stop, self.num_docs) + 1)
        d = np.diff(o)
        if len(d) and d.min() < 0:
            self._bad_offsets()
        return d

    def length(self, i: int) -> int:
        a, b = self.offsets.pair(i)
        return b - a

    def _tokens(self, i: int, start: int, stop: Optional[int]) -> np.ndarray:
        base, end = self.offsets.pair(i)
        stop = end - base if stop is None else min(stop, end - base)
        n = max(0, stop - start)
        item = self.dtype.itemsize
        raw = self._bin.pread(n * item, HEADER_SIZE + (base + start) * item)
        if len(raw) != n * item:
            raise DataError(f"{self.path}: truncated .bin: document {i} lies past the end of the file")
        return np.frombuffer(raw, dtype=self.dtype)

    def read(self, i: int, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        return self._tokens(i, start, stop).astype(np.int64)

    def read_into(self, out: np.ndarray, i: int, start: int, stop: int) -> None:
        out[:] = self._tokens(i, start, stop)

    def fingerprint(self) -> dict:
        return {"format": self.format, "bin": stat_key(self.path), "meta": stat_key(self.meta_path),
                "file_id": self.file_id.hex(), "crc": self.crc}


def open_token_file(path: str, meta_path: Optional[str] = None, verify: Optional[bool] = None) -> TokenFile:
    """Open `path` with its index: ours or InternLM's (`X.bin.meta`), or Megatron's (`X.idx`).

    `verify`: run the file's `check()` now (None: when the file is at most VERIFY_MAX_BYTES).
    """
    path = str(path)
    meta_path = meta_path or path + ".meta"
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    if os.path.isdir(path):
        raise DataError(f"{path}: is a folder, expected a .bin file")
    with open(path, "rb") as fh:
        head = fh.read(len(BIN_MAGIC))
    if head == BIN_MAGIC:
        return OursTokenFile(path, meta_path, verify)
    idx = idx_path_for(path)
    if not os.path.exists(meta_path) and os.path.exists(idx):
        return MegatronTokenFile(path, idx, verify)
    if not head:
        raise DataError(f"{path}: empty .bin file")
    if head.startswith(b"{"):
        return InternLMTokenFile(path, meta_path, verify)
    raise DataError(f"{path}: unknown or corrupted .bin: starts with {head!r}, neither our header "
                    f"({BIN_MAGIC!r}) nor an InternLM JSON line, and there is no Megatron index {idx}")


# ----------------------------------------------------------------------------------------------------------------
# writers


class OursWriter:
    """Streams documents into our format; `close()` writes the meta and finalizes the header."""

    def __init__(self, bin_path: str, meta_path: str, vocab_size: int, signed: bool = False):
        self.bin_path, self.meta_path = bin_path, meta_path
        self.vocab_size = vocab_size
        self.dtype = dtype_for(vocab_size, signed)
        self.signed = signed
        self.file_id = uuid.uuid4().bytes
        self._fh = open(bin_path, "wb")
        self._fh.write(b"\0" * HEADER_SIZE)
        self._lengths: list[int] = []
        self.num_tokens = 0
        self._crc = 0

    def _check(self, arr: np.ndarray) -> None:
        if len(arr) == 0:
            return
        lo, hi = int(arr.min()), int(arr.max())
        if hi >= self.vocab_size or (lo < 0 and not self.signed) or lo <= -self.vocab_size:
            bad = hi if hi >= self.vocab_size else lo
            raise DataError(f"{self.bin_path}: token id {bad} does not fit the vocabulary of {self.vocab_size} ids"
                            + ("" if self.signed or bad >= 0 else " (negative ids need a signed file)"))

    def write(self, ids) -> None:
        arr = np.asarray(ids, dtype=np.int64)
        self._check(arr)
        data = arr.astype(self.dtype).tobytes()
        self._crc = zlib.crc32(data, self._crc)
        self._fh.write(data)
        self._lengths.append(len(arr))
        self.num_tokens += len(arr)

    def write_many(self, flat: np.ndarray, lengths) -> None:
        """Append many documents at once: their ids concatenated in `flat` and their `lengths`."""
        flat = np.asarray(flat, dtype=np.int64)
        self._check(flat)
        data = flat.astype(self.dtype).tobytes()
        self._crc = zlib.crc32(data, self._crc)
        self._fh.write(data)
        self._lengths.extend(int(x) for x in lengths)
        self.num_tokens += int(len(flat))

    def close(self) -> None:
        ndocs = len(self._lengths)
        self._fh.seek(0)
        self._fh.write(_BIN_HEADER.pack(BIN_MAGIC, VERSION, self.dtype.itemsize, int(self.dtype.kind == "i"), 0,
                                        self.vocab_size, self.num_tokens, ndocs, self.file_id))
        self._fh.close()
        offsets = np.zeros(ndocs + 1, dtype="<i8")
        np.cumsum(np.asarray(self._lengths, dtype=np.int64), out=offsets[1:])
        with open(self.meta_path, "wb") as fh:
            fh.write(_META_HEADER.pack(META_MAGIC, VERSION, ndocs, self.num_tokens, self.file_id, self._crc, HAS_CRC))
            fh.write(offsets.tobytes())


def make_writer(fmt: str, bin_path: str, meta_path: str, vocab_size: int, signed: bool = False):
    """A writer of `fmt` ("ours", "internlm" or "megatron"; Megatron's index is `X.idx`, not `meta_path`)."""
    if fmt == "ours":
        return OursWriter(bin_path, meta_path, vocab_size, signed)
    if fmt == "internlm":
        return InternLMWriter(bin_path, meta_path, vocab_size, signed)
    if fmt == "megatron":
        return MegatronWriter(bin_path, meta_path, vocab_size, signed)
    raise DataError(f"unknown output format {fmt!r}: expected 'ours', 'internlm' or 'megatron'")




def verify_token_file(path: str) -> TokenFile:
    """Open `path` and check all of it: the whole index, our format's CRC, every line of an InternLM file."""
    f = open_token_file(path, verify=True)
    if isinstance(f, InternLMTokenFile):
        for i in range(f.num_docs):
            f.read(i)
    return f
