"""Text → tokens → `.bin` + `.bin.meta`: the library behind tools/tokenizer.py.

Input files: ``.txt``, ``.json``, ``.jsonl``, each optionally ``.gz``; a folder is walked (sorted, following links)
and its tree mirrored in the output folder (``in/a/b.jsonl`` → ``out/a/b.bin``), so that subfolders become
dataset types.

Documents:
- txt: every non-empty line, stripped (InternLM's rule);
- jsonl: every non-blank line is a JSON record; the document is its `text_key` field;
- json: a list of records (or one record); the document is each record's `text_key` field.
With ``text_key=None`` (``--text-key ''`` / ``--internlm-compat``) json records are ``json.dumps``-ed and jsonl
lines are tokenized raw, JSON syntax and newline included, exactly as InternLM's tools/tokenizer.py did. A record
whose text is empty is skipped (counted in the summary), except in that compatibility mode.

Errors (`DataError`, naming file and line): malformed JSON, a record without the text field or with a non-string
one, bytes that are not UTF-8, an empty input. With ``on_error="skip"`` the offending line (or empty file) is
skipped and counted instead.

Every output is written under a temporary name (``X.bin.tmp<pid>``, which no reader picks up) and renamed only when
complete, meta first, so an interrupted run never leaves a pair that looks finished.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Tuple

import numpy as np

from internlm_core.errors import DataError

from .formats import dtype_for, make_writer
from .megatron import idx_path_for

INPUT_EXTS = (".txt", ".json", ".jsonl")


@dataclass
class Options:
    text_key: Optional[str] = "text"     # None: InternLM's behaviour (whole record / raw line)
    add_bos: bool = True
    add_eos: bool = True
    fmt: str = "ours"                    # "ours" | "internlm" | "megatron"
    workers: int = 1
    on_error: str = "fail"               # "fail" | "skip"
    batch_bytes: int = 1 << 20           # text handed to the tokenizer at once
    max_warnings: int = 10


@dataclass
class Stats:
    files: int = 0
    docs: int = 0
    tokens: int = 0
    bytes_in: int = 0
    seconds: float = 0.0
    skipped: Counter = field(default_factory=Counter)
    empty_texts: int = 0
    outputs: List[Tuple[str, str, int, int]] = field(default_factory=list)  # (input, output, docs, tokens)


def input_format(path: str) -> str:
    name = path[:-3] if path.endswith(".gz") else path
    for ext in INPUT_EXTS:
        if name.endswith(ext):
            return ext[1:]
    raise DataError(f"{path}: unsupported input file type (expected .txt, .json or .jsonl, optionally .gz)")


def _is_input(name: str) -> bool:
    base = name[:-3] if name.endswith(".gz") else name
    return base.endswith(INPUT_EXTS)


def plan(input_path: str, output_path: str) -> List[Tuple[str, str]]:
    """[(input file, output .bin)]: one output per input file; a folder's tree is mirrored."""
    if not os.path.exists(input_path):
        raise DataError(f"{input_path}: no such file or folder")
    if os.path.isfile(input_path):
        input_format(input_path)
        out = output_path
        if os.path.isdir(out) or out.endswith(os.sep):
            base = os.path.basename(input_path)
            base = base[:-3] if base.endswith(".gz") else base
            out = os.path.join(out, os.path.splitext(base)[0] + ".bin")
        return [(input_path, out)]
    pairs = []
    seen = set()
    for root, dirs, files in os.walk(input_path, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs.sort()
        for f in sorted(files):
            if not _is_input(f):
                continue
            src = os.path.join(root, f)
            rel = os.path.relpath(src, input_path)
            rel = rel[:-3] if rel.endswith(".gz") else rel
            pairs.append((src, os.path.join(output_path, os.path.splitext(rel)[0] + ".bin")))
    if not pairs:
        raise DataError(f"{input_path}: empty folder: no .txt, .json or .jsonl files (optionally .gz) in it")
    outs = Counter(o for _, o in pairs)
    dup = [o for o, n in outs.items() if n > 1]
    if dup:
        srcs = [s for s, o in pairs if o == dup[0]]
        raise DataError(f"{dup[0]}: would be written from several inputs ({', '.join(srcs)}); rename one of them")
    return pairs


class _Skipper:
    def __init__(self, opts: Options, stats: Stats, warn: Callable[[str], None]):
        self.opts, self.stats, self.warn = opts, stats, warn

    def __call__(self, kind: str, message: str) -> None:
        if self.opts.on_error != "skip":
            raise DataError(message)
        self.stats.skipped[kind] += 1
        if sum(self.stats.skipped.values()) <= self.opts.max_warnings:
            self.warn(f"skipped: {message}")


def _open_binary(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _raw_pos(fh) -> int:
    inner = getattr(fh, "fileobj", None)  # gzip: the compressed position
    try:
        return (inner or fh).tell()
    except (OSError, ValueError):
        return 0


def _decode(raw: bytes, path: str, lineno: int, skip: _Skipper) -> Optional[str]:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        skip("non-UTF-8", f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})")
        return None


def _text_lines(text: str) -> List[str]:
    """Python's universal-newline split of one binary line (InternLM read files in text mode)."""
    if "\r" not in text:
        return [text]
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    parts = text.split("\n")
    out = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        out.append(parts[-1])
    return out


def _record_text(rec, key: str, where: str, skip: _Skipper) -> Optional[str]:
    if isinstance(rec, str):
        return rec
    if not isinstance(rec, dict):
        skip("not a record", f"{where}: expected a JSON object with a {key!r} field, got {type(rec).__name__}")
        return None
    if key not in rec:
        keys = ", ".join(repr(k) for k in list(rec)[:8])
        skip("missing text key", f"{where}: record has no {key!r} field (its fields: {keys}; choose one with --text-key)")
        return None
    val = rec[key]
    if not isinstance(val, str):
        skip("non-string text", f"{where}: field {key!r} is {type(val).__name__}, expected a string")
        return None
    return val


def iter_documents(path: str, opts: Options, skip: _Skipper, cursor: Optional[dict] = None) -> Iterator[str]:
    """The text of every document of `path`; `cursor["fh"]` is the open file (for progress by position)."""
    fmt = input_format(path)
    compat = opts.text_key is None
    with _open_binary(path) as fh:
        if cursor is not None:
            cursor["fh"] = fh
        if fmt == "json":
            try:
                raw = fh.read()
            except (OSError, EOFError) as e:
                raise DataError(f"{path}: cannot read ({e})") from None
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                line = raw[: e.start].count(b"\n") + 1
                skip("non-UTF-8 .json file", f"{path}:{line}: not valid UTF-8 (byte 0x{raw[e.start]:02x})"
                     + ("; a .json file is parsed whole, so all of it is skipped" if opts.on_error == "skip" else ""))
                if cursor is not None:
                    cursor["skipped_whole"] = True
                return
            if not compat and text.startswith("\ufeff"):
                text = text[1:]
            if not text.strip():
                return
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                skip("malformed .json file", f"{path}:{e.lineno}: malformed JSON at column {e.colno}: {e.msg}"
                     + ("; a .json file is parsed whole, so all of it is skipped" if opts.on_error == "skip" else ""))
                if cursor is not None:
                    cursor["skipped_whole"] = True
                return
            records = data if isinstance(data, list) else [data]
            for n, rec in enumerate(records):
                if compat:
                    doc = json.dumps(rec)
                else:
                    doc = _record_text(rec, opts.text_key, f"{path}: record {n}", skip)
                    if doc is None:
                        continue
                yield doc
            return
        lineno = 0
        try:
            for raw in fh:
                lineno += 1
                if lineno == 1 and raw.startswith(b"\xef\xbb\xbf") and not compat:
                    raw = raw[3:]
                if fmt == "txt":
                    if not raw.strip():
                        continue
                    line = _decode(raw, path, lineno, skip)
                    if line is None:
                        continue
                    for piece in _text_lines(line):
                        piece = piece.strip()
                        if piece:
                            yield piece
                elif compat:  # jsonl, InternLM: every raw line is the document
                    line = _decode(raw, path, lineno, skip)
                    if line is None:
                        continue
                    yield from _text_lines(line)
                else:
                    if not raw.strip():
                        continue
                    line = _decode(raw, path, lineno, skip)
                    if line is None:
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        skip("malformed JSON", f"{path}:{lineno}: malformed JSON at column {e.colno}: {e.msg}")
                        continue
                    doc = _record_text(rec, opts.text_key, f"{path}:{lineno}", skip)
                    if doc is not None:
                        yield doc
        except (OSError, EOFError) as e:  # a broken .gz
            raise DataError(f"{path}:{lineno + 1}: cannot read ({e})") from None


def tokenize_file(src: str, dst: str, tokenizer, opts: Options, stats: Stats, skip: _Skipper,
                  progress: Callable[[int, int, int], None]) -> None:
    """Tokenize one input file into `dst` (+ `.meta`), through temporary names.

    `progress(bytes_read_in_this_file, new_docs, new_tokens)` is called after every batch.
    """
    nb = 1 if opts.add_bos else 0
    ne = 1 if opts.add_eos else 0
    if opts.add_bos and tokenizer.bos_id is None:
        raise DataError(f"--tokenizer {tokenizer.name}: has no BOS token; pass --no-add-bos (or --bos-token)")
    if opts.add_eos and tokenizer.eos_id is None:
        raise DataError(f"--tokenizer {tokenizer.name}: has no EOS token; pass --no-add-eos (or --eos-token)")
    if os.path.getsize(src) == 0:
        skip("empty file", f"{src}: empty file (no documents)")
        return
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    meta = idx_path_for(dst) if opts.fmt == "megatron" else dst + ".meta"
    tmp_bin, tmp_meta = f"{dst}.tmp{os.getpid()}", f"{meta}.tmp{os.getpid()}"
    writer = make_writer(opts.fmt, tmp_bin, tmp_meta, tokenizer.vocab_size)
    docs = toks = 0
    cursor: dict = {}

    def encode_and_write(texts: List[str], pos: int) -> None:
        # runs in a helper thread: the tokenizers release the GIL, so reading and parsing the next batch overlaps
        nonlocal docs, toks
        encoded = tokenizer.encode_batch(texts, opts.workers)
        lengths = [len(e) + nb + ne for e in encoded]
        total = sum(lengths)
        if opts.fmt in ("ours", "megatron"):
            flat = np.empty(total, dtype=np.int64)
            p = 0
            for e, n in zip(encoded, lengths):
                if nb:
                    flat[p] = tokenizer.bos_id
                flat[p + nb: p + n - ne] = e
                if ne:
                    flat[p + n - 1] = tokenizer.eos_id
                p += n
            writer.write_many(flat, lengths)
        else:
            pre = [tokenizer.bos_id] if nb else []
            post = [tokenizer.eos_id] if ne else []
            for e in encoded:
                writer.write(pre + (e.tolist() if isinstance(e, np.ndarray) else list(e)) + post)
        docs += len(texts)
        toks += total
        progress(pos, len(lengths), total)

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
    pending = None
    try:
        texts: List[str] = []
        batch_chars = 0

        def submit():
            nonlocal pending, texts, batch_chars
            job = pool.submit(encode_and_write, texts, _raw_pos(cursor["fh"]))
            if pending is not None:
                pending.result()  # at most one batch encoding while the next one is read
            pending = job
            texts, batch_chars = [], 0

        for text in iter_documents(src, opts, skip, cursor):
            if not text and opts.text_key is not None:
                stats.empty_texts += 1
                continue
            texts.append(text)
            batch_chars += len(text)
            if batch_chars >= opts.batch_bytes:
                submit()
        if texts:
            submit()
        if pending is not None:
            pending.result()
            pending = None
        writer.close()
        if docs == 0:
            for p in (tmp_bin, tmp_meta):
                os.remove(p)
            if not cursor.get("skipped_whole"):
                skip("empty file", f"{src}: no documents in it (only blank lines, empty texts or skipped records)")
            return
        os.replace(tmp_meta, meta)
        os.replace(tmp_bin, dst)
    except BaseException:
        if pending is not None:  # let the helper finish before its file is removed
            pending.cancel()
            try:
                pending.result()
            except BaseException:  # noqa: BLE001 - the first error is the one to report
                pass
        try:
            writer._fh.close()
        except Exception:  # closing a half-written temp file must not hide the real error
            pass
        for p in (tmp_bin, tmp_meta):
            if os.path.exists(p):
                os.remove(p)
        raise
    finally:
        pool.shutdown(wait=True)
    stats.files += 1
    stats.docs += docs
    stats.tokens += toks
    stats.outputs.append((src, dst, docs, toks))


class Progress:
    """One self-rewriting status line on stderr (only on a terminal): input MB, %, documents, tokens, MB/s."""

    def __init__(self, total_bytes: int, stream=None, interval: float = 0.5, force: bool = False):
        self.stream = stream or sys.stderr
        self.enabled = force or (hasattr(self.stream, "isatty") and self.stream.isatty())
        self.total, self.interval = max(1, total_bytes), interval
        self.bytes = self.docs = self.tokens = 0
        self.t0 = self.last = time.perf_counter()

    def line(self) -> str:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        return (f"tokenizing: {self.bytes / 1e6:.1f}/{self.total / 1e6:.1f} MB ({100 * self.bytes / self.total:.0f}%), "
                f"{self.docs:,} documents, {self.tokens:,} tokens, {self.bytes / 1e6 / dt:.2f} MB/s")

    def update(self, nbytes: int, ndocs: int, ntokens: int) -> None:
        self.bytes += nbytes
        self.docs += ndocs
        self.tokens += ntokens
        now = time.perf_counter()
        if self.enabled and now - self.last >= self.interval:
            self.last = now
            self.stream.write("\r" + self.line() + "\x1b[K")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + self.line() + "\x1b[K\n")
            self.stream.flush()


def tokenize_paths(input_path: str, output_path: str, tokenizer, opts: Options,
                   progress_bar: bool = True, warn: Optional[Callable[[str], None]] = None) -> Stats:
    """Tokenize a file or folder tree; returns the statistics (see module docstring)."""
    if opts.fmt not in ("ours", "internlm", "megatron"):
        raise DataError(f"--format {opts.fmt}: expected 'ours', 'internlm' or 'megatron'")
    if opts.on_error not in ("fail", "skip"):
        raise DataError(f"--on-error {opts.on_error}: expected 'fail' or 'skip'")
    warn = warn or (lambda m: print(m, file=sys.stderr))
    pairs = plan(input_path, output_path)
    stats = Stats()
    skip = _Skipper(opts, stats, warn)
    bar = Progress(sum(os.path.getsize(src) for src, _ in pairs)) if progress_bar else None
    t0 = time.perf_counter()
    try:
        for src, dst in pairs:
            size = os.path.getsize(src)
            shown = {"bytes": 0}

            def progress(pos, ndocs, ntok, _shown=shown, _size=size):
                pos = min(pos, _size)
                if bar is not None:
                    bar.update(max(0, pos - _shown["bytes"]), ndocs, ntok)
                _shown["bytes"] = max(pos, _shown["bytes"])

            tokenize_file(src, dst, tokenizer, opts, stats, skip, progress)
            stats.bytes_in += size
            if bar is not None:
                bar.update(size - shown["bytes"], 0, 0)
    finally:
        if bar is not None:
            bar.close()
    stats.seconds = time.perf_counter() - t0
    if stats.docs == 0:
        raise DataError(f"{input_path}: no documents found (every input was empty or skipped)")
    return stats


def describe_dtype(fmt: str, vocab_size: int) -> str:
    if fmt == "megatron":
        return "uint16" if vocab_size <= 2**16 else "int32"
    return "JSON lines" if fmt == "internlm" else f"{dtype_for(vocab_size).name}"
