"""Tokenizers for tools/tokenizer.py: SentencePiece model, Hugging Face `tokenizer.json`, built-in bytes.

Each has `name`, `vocab_size`, `bos_id`, `eos_id` (None when it has none), `encode_batch(texts, threads)` →
list of id lists (no special tokens), and `decode(ids)`.

The built-in byte tokenizer (``--tokenizer byte``) needs no file: ids 0..255 are the UTF-8 bytes of the text,
256 is BOS, 257 is EOS, 258 is reserved for padding; vocab_size = 259.
"""

from __future__ import annotations

import contextlib
import os
from typing import List, Optional, Sequence

import numpy as np

from internlm_core.errors import DataError

BYTE_VOCAB_SIZE = 259
BYTE_BOS, BYTE_EOS, BYTE_PAD = 256, 257, 258


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus BOS 256, EOS 257, PAD 258 (vocab 259)."""

    name = "byte"
    vocab_size = BYTE_VOCAB_SIZE
    bos_id: Optional[int] = BYTE_BOS
    eos_id: Optional[int] = BYTE_EOS
    pad_id = BYTE_PAD

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str], threads: int = 1) -> List[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (C++ log lines) for the duration; Python exceptions still propagate."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class SentencePieceTokenizer:
    """A SentencePiece `.model` file (InternLM's V7_sft.model, Llama's tokenizer.model, ...)."""

    def __init__(self, path: str, internlm_compat: bool = False):
        import sentencepiece as spm

        self.name = path
        try:
            with _quiet_stderr():  # its C++ logger warns about harmless pieces (e.g. "\\0" in V7_sft.model)
                self.sp = spm.SentencePieceProcessor(model_file=path)
        except Exception as e:  # sentencepiece raises RuntimeError/OSError with its own text
            raise DataError(f"{path}: not a SentencePiece model ({e})") from None
        self.vocab_size = int(self.sp.get_piece_size())
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None
        # Hugging Face's slow tokenizer (InternLM's tools/tokenizer.py) never passes the text of its special tokens
        # to SentencePiece: it splits the text around them and maps them to their ids.
        self._specials = {}
        if internlm_compat:
            for i in (self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id()):
                if i >= 0:
                    self._specials[self.sp.id_to_piece(i)] = i

    def encode(self, text: str) -> List[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str], threads: int = 1) -> List[List[int]]:
        if self._specials and any(s in t for t in texts for s in self._specials):
            return [self._encode_split(t) for t in texts]
        return self.sp.encode(list(texts), num_threads=max(1, threads))

    def _encode_split(self, text: str) -> List[int]:
        out: List[int] = []
        rest = text
        while rest:
            hits = [(rest.find(s), s) for s in self._specials if s in rest]
            if not hits:
                out.extend(self.sp.encode(rest))
                break
            pos, s = min(hits, key=lambda h: (h[0], -len(h[1])))
            if pos > 0:
                out.extend(self.sp.encode(rest[:pos]))
            out.append(self._specials[s])
            rest = rest[pos + len(s):]
        return out

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (the `tokenizers` library); encoding runs in its Rust thread pool."""

    BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<|startoftext|>", "<bos>", "[BOS]")
    EOS_CANDIDATES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "[EOS]", "<|im_end|>")

    def __init__(self, path: str, bos_token: Optional[str] = None, eos_token: Optional[str] = None):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(f"{path}: reading a tokenizer.json needs the `tokenizers` package (pip install tokenizers)") from None
        self.name = path
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises its own Exception type
            raise DataError(f"{path}: not a Hugging Face tokenizer.json ({e})") from None
        self.vocab_size = int(self.tok.get_vocab_size(with_added_tokens=True))
        self.bos_id = self._special(bos_token, self.BOS_CANDIDATES, "bos")
        self.eos_id = self._special(eos_token, self.EOS_CANDIDATES, "eos")

    def _special(self, given: Optional[str], candidates, what: str) -> Optional[int]:
        if given:
            i = self.tok.token_to_id(given)
            if i is None:
                raise DataError(f"{self.name}: has no token {given!r} (given as the {what} token)")
            return int(i)
        for c in candidates:
            i = self.tok.token_to_id(c)
            if i is not None:
                return int(i)
        return None

    def encode(self, text: str) -> List[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], threads: int = 1) -> List[List[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


def load_tokenizer(spec: str, *, internlm_compat: bool = False, bos_token: Optional[str] = None,
                   eos_token: Optional[str] = None):
    """`byte`, a SentencePiece `.model`, a `tokenizer.json`, or a folder holding one of them."""
    if spec in ("byte", "bytes"):
        return ByteTokenizer()
    if not os.path.exists(spec):
        raise DataError(f"--tokenizer {spec}: no such file (expected 'byte', a SentencePiece .model or a tokenizer.json)")
    path = spec
    if os.path.isdir(spec):
        for name in ("tokenizer.json", "tokenizer.model"):
            if os.path.isfile(os.path.join(spec, name)):
                path = os.path.join(spec, name)
                break
        else:
            models = sorted(f for f in os.listdir(spec) if f.endswith(".model"))
            if not models:
                raise DataError(f"--tokenizer {spec}: folder has no tokenizer.json, tokenizer.model or *.model")
            path = os.path.join(spec, models[0])
    if path.endswith(".json"):
        return HFTokenizer(path, bos_token, eos_token)
    return SentencePieceTokenizer(path, internlm_compat=internlm_compat)
