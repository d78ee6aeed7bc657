"""Input text files → documents, for text2bin (its module docstring states the rules: which lines and records are
documents, InternLM's compatibility mode, the errors).

    for text in iter_documents(path, opts, skip):   # opts: text_key, on_error; skip(kind, message) raises or counts
"""

from __future__ import annotations

import gzip
import json
from typing import Any, BinaryIO, Callable, Iterator, List, Optional, Protocol

from internlm_core.errors import DataError

INPUT_EXTS = (".txt", ".json", ".jsonl")

# skip(kind, message): raises DataError(message), or (on_error="skip") counts the kind and warns
Skip = Callable[[str, str], None]


class DocumentOptions(Protocol):
    """What reading documents needs of text2bin.Options."""

    text_key: Optional[str]  # None: InternLM's behaviour (whole record / raw line)
    on_error: str            # "fail" | "skip"


def input_format(path: str) -> str:
    name = path[:-3] if path.endswith(".gz") else path
    for ext in INPUT_EXTS:
        if name.endswith(ext):
            return ext[1:]
    raise DataError(f"{path}: unsupported input file type (expected .txt, .json or .jsonl, optionally .gz)")


def is_input(name: str) -> bool:
    base = name[:-3] if name.endswith(".gz") else name
    return base.endswith(INPUT_EXTS)


def _open_binary(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _decode(raw: bytes, path: str, lineno: int, skip: Skip) -> Optional[str]:
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


def _record_text(rec, key: str, where: str, skip: Skip) -> Optional[str]:
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


def iter_documents(path: str, opts: DocumentOptions, skip: Skip, cursor: Optional[dict] = None) -> Iterator[str]:
    """The text of every document of `path`; `cursor["fh"]` is the open file (for progress by position), and
    `cursor["skipped_whole"]` is set when a .json file was skipped as a whole."""
    fmt = input_format(path)
    with _open_binary(path) as fh:
        if cursor is not None:
            cursor["fh"] = fh
        if fmt != "json":
            yield from _line_documents(fh, path, fmt, opts, skip)
            return
        records = _json_records(fh, path, opts, skip)
        if records is None and cursor is not None:
            cursor["skipped_whole"] = True
        for n, rec in enumerate(records or []):
            if opts.text_key is None:  # InternLM: the whole record, as JSON
                yield json.dumps(rec)
                continue
            doc = _record_text(rec, opts.text_key, f"{path}: record {n}", skip)
            if doc is not None:
                yield doc


def _json_records(fh: BinaryIO, path: str, opts: DocumentOptions, skip: Skip) -> Optional[List[Any]]:
    """The records of a .json file (a list of them, or one): [] when it is blank, None when it is skipped. The file
    is parsed whole, so bytes that are not UTF-8 or malformed JSON anywhere in it skip all of it."""
    try:
        raw = fh.read()
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    whole = "; a .json file is parsed whole, so all of it is skipped" if opts.on_error == "skip" else ""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        skip("non-UTF-8 .json file", f"{path}:{line}: not valid UTF-8 (byte 0x{raw[e.start]:02x})" + whole)
        return None
    if opts.text_key is not None and text.startswith("\ufeff"):  # a BOM (InternLM's compatibility mode keeps it)
        text = text[1:]
    if not text.strip():
        return []
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        skip("malformed .json file", f"{path}:{e.lineno}: malformed JSON at column {e.colno}: {e.msg}" + whole)
        return None
    return data if isinstance(data, list) else [data]


def _line_documents(fh: BinaryIO, path: str, fmt: str, opts: DocumentOptions, skip: Skip) -> Iterator[str]:
    """The documents of a .txt or .jsonl file, read line by line in binary (a bad line is named by its number)."""
    lineno = 0
    try:
        for raw in fh:
            lineno += 1
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf") and opts.text_key is not None:
                raw = raw[3:]  # a BOM (InternLM's compatibility mode keeps it)
            yield from _line_docs(raw, path, lineno, fmt, opts, skip)
    except (OSError, EOFError) as e:  # a broken .gz
        raise DataError(f"{path}:{lineno + 1}: cannot read ({e})") from None


def _line_docs(raw: bytes, path: str, lineno: int, fmt: str, opts: DocumentOptions, skip: Skip) -> List[str]:
    """The documents of one line: a .txt line's stripped pieces; InternLM's compatibility mode: a .jsonl line as it
    is; else the text field of the line's JSON record. Blank lines hold none (except in compatibility mode)."""
    compat = opts.text_key is None
    if not raw.strip() and not (fmt == "jsonl" and compat):
        return []
    line = _decode(raw, path, lineno, skip)
    if line is None:
        return []
    if fmt == "txt":
        return [p for p in (piece.strip() for piece in _text_lines(line)) if p]
    if compat:  # jsonl, InternLM: every raw line is the document
        return _text_lines(line)
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        skip("malformed JSON", f"{path}:{lineno}: malformed JSON at column {e.colno}: {e.msg}")
        return []
    doc = _record_text(rec, opts.text_key, f"{path}:{lineno}", skip)
    return [] if doc is None else [doc]
