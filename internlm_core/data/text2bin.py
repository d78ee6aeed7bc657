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

import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Tuple

import numpy as np

from internlm_core.errors import DataError

from .formats import dtype_for, make_writer
from .megatron import idx_path_for
from .text_documents import input_format, is_input, iter_documents  # reading the documents of the input files


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
            if not is_input(f):
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


def _raw_pos(fh) -> int:
    inner = getattr(fh, "fileobj", None)  # gzip: the compressed position
    try:
        return (inner or fh).tell()
    except (OSError, ValueError):
        return 0


def _check_special_tokens(tokenizer, opts: Options) -> None:
    """Refuse a tokenizer without the BOS / EOS the rows are to get, before any file is written."""
    if opts.add_bos and tokenizer.bos_id is None:
        raise DataError(f"--tokenizer {tokenizer.name}: has no BOS token; pass --no-add-bos (or --bos-token)")
    if opts.add_eos and tokenizer.eos_id is None:
        raise DataError(f"--tokenizer {tokenizer.name}: has no EOS token; pass --no-add-eos (or --eos-token)")


def tokenize_file(src: str, dst: str, tokenizer, opts: Options, stats: Stats, skip: _Skipper,
                  progress: Callable[[int, int, int], None]) -> None:
    """Tokenize one input file into `dst` (+ `.meta`), through temporary names.

    `progress(bytes_read_in_this_file, new_docs, new_tokens)` is called after every batch.
    """
    _check_special_tokens(tokenizer, opts)
    if os.path.getsize(src) == 0:
        skip("empty file", f"{src}: empty file (no documents)")
        return
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    meta = idx_path_for(dst) if opts.fmt == "megatron" else dst + ".meta"
    tmp_bin, tmp_meta = f"{dst}.tmp{os.getpid()}", f"{meta}.tmp{os.getpid()}"
    writer = make_writer(opts.fmt, tmp_bin, tmp_meta, tokenizer.vocab_size)
    cursor: dict = {}
    try:
        docs, toks = _tokenize_into(writer, src, tokenizer, opts, stats, skip, progress, cursor)
        writer.close()
        if docs == 0:
            for p in (tmp_bin, tmp_meta):
                os.remove(p)
            if not cursor.get("skipped_whole"):
                skip("empty file", f"{src}: no documents in it (only blank lines, empty texts or skipped records)")
            return
        os.replace(tmp_meta, meta)  # meta first: a .bin without its meta is never taken for a finished pair
        os.replace(tmp_bin, dst)
    except BaseException:
        try:
            writer._fh.close()
        except Exception:  # closing a half-written temp file must not hide the real error
            pass
        for p in (tmp_bin, tmp_meta):
            if os.path.exists(p):
                os.remove(p)
        raise
    stats.files += 1
    stats.docs += docs
    stats.tokens += toks
    stats.outputs.append((src, dst, docs, toks))


def _tokenize_into(writer, src: str, tokenizer, opts: Options, stats: Stats, skip: _Skipper,
                   progress: Callable[[int, int, int], None], cursor: dict) -> Tuple[int, int]:
    """Encode and write the documents of `src` batch by batch, each batch in a helper thread while the next one is
    read and parsed (the tokenizers release the GIL), at most one batch in flight; (documents, tokens) written.
    On an error the batch in flight is waited for before the error goes up, so the caller may remove its file."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
    pending: Optional[Future] = None
    docs = toks = 0
    try:
        for texts in _batches(src, opts, stats, skip, cursor):
            job = pool.submit(_encode_and_write, writer, tokenizer, texts, opts, _raw_pos(cursor["fh"]), progress)
            if pending is not None:
                d, t = pending.result()
                docs, toks = docs + d, toks + t
            pending = job
        if pending is not None:
            d, t = pending.result()
            docs, toks, pending = docs + d, toks + t, None
    except BaseException:
        if pending is not None:
            pending.cancel()
            try:
                pending.result()
            except BaseException:  # noqa: BLE001 - the first error is the one to report
                pass
        raise
    finally:
        pool.shutdown(wait=True)
    return docs, toks


def _batches(src: str, opts: Options, stats: Stats, skip: _Skipper, cursor: dict) -> Iterator[List[str]]:
    """The documents of `src` in lists of about `opts.batch_bytes` characters (what the tokenizer gets at once);
    empty texts are counted and dropped, except in InternLM's compatibility mode (text_key None), which keeps them."""
    texts: List[str] = []
    chars = 0
    for text in iter_documents(src, opts, skip, cursor):
        if not text and opts.text_key is not None:
            stats.empty_texts += 1
            continue
        texts.append(text)
        chars += len(text)
        if chars >= opts.batch_bytes:
            yield texts
            texts, chars = [], 0
    if texts:
        yield texts


def _encode_and_write(writer, tokenizer, texts: List[str], opts: Options, pos: int,
                      progress: Callable[[int, int, int], None]) -> Tuple[int, int]:
    """Encode one batch, put BOS / EOS around each document and write the rows (the binary formats as one flat
    array); (documents, tokens). `pos`: how far into the input file the batch ends, for progress."""
    nb, ne = int(opts.add_bos), int(opts.add_eos)
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
    progress(pos, len(lengths), total)
    return len(texts), total


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
