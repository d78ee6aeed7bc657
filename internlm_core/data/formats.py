"""On-disk token formats: ours (compact binary) and InternLM's (JSON lines), both memory-mapped.

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
                The training loader checks the CRCs when it opens a folder holding at most 1 GiB of such files (a
                few ms per 100 MB once they are in the page cache; a bigger folder would make every rank read all of
                it at start-up); `verify_token_file` / ``python -m internlm_core.data.formats PATH...`` check any
                size.

InternLM's format (``--format internlm``): ``X.bin`` holds one line per document, the UTF-8 bytes of
``json.dumps({"tokens": [...]}) + "\\n"``; ``X.bin.meta`` is ``np.save`` of an int32 array of shape (N, 2), rows
(byte offset of the line, number of tokens).

`open_token_file(path)` detects the format from the first bytes of the bin and returns a `TokenFile`; every
inconsistency found (truncation, bad magic, a meta of another file, offsets out of range, a line whose token count
differs from the meta) raises `DataError` naming the file, and for InternLM files the line number.
"""

from __future__ import annotations

import json
import os
import struct
import uuid
import zlib
import warnings
from typing import Optional

import numpy as np

from internlm_core.errors import DataError

BIN_MAGIC = b"\x93ILMCBIN"
META_MAGIC = b"\x93ILMCIDX"
VERSION = 1
HEADER_SIZE = 64
_BIN_HEADER = struct.Struct("<8sHBBIQQQ16s8x")   # 64 bytes
_META_HEADER = struct.Struct("<8sH6xQQ16sII8x")  # 64 bytes
HAS_CRC = 1
VERIFY_MAX_BYTES = 1 << 30  # by default, token data up to this size is checked against its CRC32 when opened
assert _BIN_HEADER.size == HEADER_SIZE and _META_HEADER.size == HEADER_SIZE  # layout constants, not user input

INTERNLM_PREFIX = b'{"tokens": ['


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


class TokenFile:
    """One tokenized file: `num_docs`, `lengths` (int64 array), `read(i, start, stop)` → int64 token ids."""

    format: str = ""
    path: str
    lengths: np.ndarray
    vocab_size: Optional[int] = None

    @property
    def num_docs(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def read(self, i: int, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        raise NotImplementedError

    def read_into(self, out: np.ndarray, i: int, start: int, stop: int) -> None:
        """Copy tokens ``[start, stop)`` of document i into `out` (len(out) == stop - start)."""
        out[:] = self.read(i, start, stop)

    def doc_location(self, i: int) -> str:
        """How a user finds document i in this file (for error messages)."""
        return f"{self.path}: document {i}"


class OursTokenFile(TokenFile):
    format = "ours"

    def __init__(self, path: str, meta_path: str, verify: Optional[bool] = None):
        self.path = path
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
        self.vocab_size = int(vocab)
        self.dtype = dtype
        self.file_id = fid
        # the meta
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
        offsets = np.memmap(meta_path, dtype="<i8", mode="r", offset=HEADER_SIZE, shape=(ndocs + 1,))
        offsets = np.asarray(offsets, dtype=np.int64)
        if offsets[0] != 0 or offsets[-1] != ntok or (ndocs and np.any(np.diff(offsets) < 0)):
            raise DataError(f"{meta_path}: corrupted .bin.meta: document offsets are not increasing from 0 to {ntok}")
        self.offsets = offsets
        self.lengths = np.diff(offsets)
        self._mm = (np.memmap(path, dtype=dtype, mode="r", offset=HEADER_SIZE, shape=(ntok,)) if ntok
                    else np.zeros(0, dtype=dtype))
        self.crc = crc if flags & HAS_CRC else None
        if verify or (verify is None and ntok * itemsize <= VERIFY_MAX_BYTES):
            self.verify()

    def verify(self) -> None:
        """Check the token bytes against the CRC32 recorded in the meta (DataError on a mismatch)."""
        if self.crc is None:
            return
        crc = 0
        step = 1 << 26
        raw = self._mm.view(np.uint8) if len(self._mm) else np.zeros(0, np.uint8)
        for i in range(0, len(raw), step):
            crc = zlib.crc32(memoryview(np.ascontiguousarray(raw[i:i + step])), crc)
        if crc != self.crc:
            raise DataError(f"{self.path}: corrupted .bin: the token data does not match the checksum in its "
                            f".bin.meta (crc32 {crc:08x}, expected {self.crc:08x})")

    def read(self, i: int, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        base = int(self.offsets[i])
        end = int(self.offsets[i + 1])
        stop = end - base if stop is None else stop
        return self._mm[base + start: base + stop].astype(np.int64)

    def read_into(self, out: np.ndarray, i: int, start: int, stop: int) -> None:
        base = int(self.offsets[i])
        out[:] = self._mm[base + start: base + stop]


class InternLMTokenFile(TokenFile):
    format = "internlm"

    def __init__(self, path: str, meta_path: str):
        self.path = path
        size = os.path.getsize(path)
        if not os.path.exists(meta_path):
            raise DataError(f"{meta_path}: missing (every .bin needs its .bin.meta index)")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                meta = np.load(meta_path, allow_pickle=False)
        except Exception as e:  # numpy raises ValueError/EOFError/OSError/UnpicklingError for broken files
            raise DataError(f"{meta_path}: corrupted or truncated .bin.meta (not a readable .npy array: {e})") from None
        if meta.ndim != 2 or meta.shape[1] != 2 or meta.dtype.kind not in "iu":
            raise DataError(f"{meta_path}: corrupted .bin.meta: expected an integer array of shape (N, 2), "
                            f"got {meta.dtype} {meta.shape}")
        if meta.shape[0] == 0:
            raise DataError(f"{meta_path}: empty .bin.meta (no documents)")
        meta = meta.astype(np.int64)
        starts, lengths = meta[:, 0], meta[:, 1]
        if starts[0] != 0 or np.any(np.diff(starts) <= 0) or starts[-1] >= size or np.any(lengths < 0):
            raise DataError(f"{meta_path}: does not match {path}: offsets must increase from 0 and stay below the "
                            f"bin's {size} bytes, lengths must be >= 0")
        self._mm = np.memmap(path, dtype=np.uint8, mode="r")
        if self._mm[-1] != 0x0A:
            raise DataError(f"{path}: truncated InternLM .bin: the last line has no newline")
        if len(starts) > 1:
            # every entry must start a line; on big files a sample of entries is checked here (each check touches a
            # page of the file) and every line is checked against its meta entry when it is read
            check = np.arange(1, len(starts))
            if size > VERIFY_MAX_BYTES and len(check) > 100_000:
                check = np.unique(np.linspace(1, len(starts) - 1, 100_000).astype(np.int64))
            bad = check[self._mm[starts[check] - 1] != 0x0A]
            if len(bad):
                j = int(bad[0])
                raise DataError(f"{meta_path}: does not match {path}: entry {j} points to byte {int(starts[j])}, "
                                "which does not start a line")
        self.starts = starts
        self.ends = np.append(starts[1:], size)  # exclusive, includes the newline
        self.lengths = lengths
        self._cache_i = -1
        self._cache: Optional[np.ndarray] = None
        # the first and last lines are parsed now, so that a mismatched pair is noticed at open time
        self._parse(0)
        self._parse(len(starts) - 1)

    def doc_location(self, i: int) -> str:
        return f"{self.path}: line {i + 1}"

    def _parse(self, i: int) -> np.ndarray:
        if i == self._cache_i:
            return self._cache
        raw = bytes(self._mm[self.starts[i]: self.ends[i]])
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
        if len(toks) != self.lengths[i]:
            raise DataError(f"{self.path}: line {i + 1}: has {len(toks)} tokens, but {self.path}.meta says "
                            f"{int(self.lengths[i])} (meta does not match bin)")
        self._cache_i, self._cache = i, toks
        return toks

    def read(self, i: int, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        return self._parse(i)[start:stop]


def open_token_file(path: str, meta_path: Optional[str] = None, verify: Optional[bool] = None) -> TokenFile:
    """Open `path` (ours or InternLM's format, detected from its first bytes) with its `.bin.meta`.

    `verify`: check our format's CRC now (None: when the token data is at most VERIFY_MAX_BYTES).
    """
    path = str(path)
    meta_path = meta_path or path + ".meta"
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    if os.path.isdir(path):
        raise DataError(f"{path}: is a folder, expected a .bin file")
    with open(path, "rb") as fh:
        head = fh.read(len(BIN_MAGIC))
    if not head:
        raise DataError(f"{path}: empty .bin file")
    if head == BIN_MAGIC:
        return OursTokenFile(path, meta_path, verify)
    if head.startswith(b"{"):
        return InternLMTokenFile(path, meta_path)
    raise DataError(f"{path}: unknown or corrupted .bin: starts with {head!r}, neither our header "
                    f"({BIN_MAGIC!r}) nor an InternLM JSON line")


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


def make_writer(fmt: str, bin_path: str, meta_path: str, vocab_size: int, signed: bool = False):
    if fmt == "ours":
        return OursWriter(bin_path, meta_path, vocab_size, signed)
    if fmt == "internlm":
        return InternLMWriter(bin_path, meta_path, vocab_size, signed)
    raise DataError(f"unknown output format {fmt!r}: expected 'ours' or 'internlm'")


def verify_token_file(path: str) -> TokenFile:
    """Open `path` and check all of it: our format's CRC, every line of an InternLM file."""
    f = open_token_file(path)
    if isinstance(f, OursTokenFile):
        f.verify()
    else:
        for i in range(f.num_docs):
            f.read(i)
    return f


def _main(argv=None) -> int:
    import argparse
    import sys

    from .dataset import find_bin_files

    p = argparse.ArgumentParser(description="Verify .bin/.bin.meta files (ours: checksum; InternLM's: every line).")
    p.add_argument("paths", nargs="+", help=".bin files or folders of them")
    args = p.parse_args(argv)
    bad = 0
    for root in args.paths:
        try:
            files = find_bin_files(root)
            if not files:
                raise DataError(f"{root}: no .bin files found")
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            bad += 1
            continue
        for path in files:
            try:
                f = verify_token_file(path)
                print(f"ok  {path}: {f.format}, {f.num_docs} documents, {f.num_tokens} tokens")
            except DataError as e:
                print(f"error: {e}", file=sys.stderr)
                bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(_main())
