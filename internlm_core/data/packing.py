"""Packing documents into rows of `packed_length` tokens (InternLM's PackedDataset semantics, vectorized).

The documents of a stream, in a given order, form one token stream; row k is the stream's tokens
``[k * packed_length, (k + 1) * packed_length)``. A document may start in one row and continue in the next.
For each row:

- ``input_ids``: ``abs(token)`` (negative ids mean "input, but no loss", InternLM's SFT masking);
- ``labels``: the next token of the same document (also across the row's end), -100 at the last token of each
  document, at padding, and where that next token's id is negative;
- ``cu_seqlens``: 0, every document start, every multiple of `seq_len`, and `packed_length` (strictly increasing,
  int32): no attention segment spans two documents or more than `seq_len` tokens;
- ``position_ids``: position inside its ``cu_seqlens`` segment (InternLM's "indexes");
- ``type_ids``: the document's dataset type id.

With `pack_sample_into_one` (InternLM's PackedDatasetWithoutCuSeqlen), ``cu_seqlens`` holds only the multiples of
`seq_len` and positions run 0..seq_len-1 in every chunk: attention crosses documents inside a chunk. Labels are the
same as above.

Padding (only in validation, at the end of the stream): input 0, label -100, the type of the last document, and
a segment of its own in ``cu_seqlens``.

`assemble` builds a row from its fragments (pieces of documents); `Packer` finds a row's fragments through an
epoch index (index.py) and reads them from a `DocTable`; the streaming loader feeds `assemble` itself.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from internlm_core.errors import DataError

IGNORE_INDEX = -100


class Fragment:
    """A piece of one document: its tokens, type id, and the label of its last token (the document's next token,
    or IGNORE_INDEX where the document ends)."""

    __slots__ = ("tokens", "type_id", "last_label")

    def __init__(self, tokens: np.ndarray, type_id: int, last_label: int):
        self.tokens, self.type_id, self.last_label = tokens, int(type_id), int(last_label)


class RowShape:
    """The shape of packed rows: `packed_length`, `seq_len`, `pack_sample_into_one`."""

    def __init__(self, seq_len: int, packed_length: int, pack_sample_into_one: bool = False):
        if seq_len < 1 or packed_length < 1:
            raise DataError(f"data.seq_len ({seq_len}) and data.packed_length ({packed_length}) must be >= 1")
        self.seq_len, self.packed_length = int(seq_len), int(packed_length)
        self.pack_into_one = bool(pack_sample_into_one)
        self._chunk_starts = np.arange(0, self.packed_length, self.seq_len, dtype=np.int64)
        if self.pack_into_one:
            self._fixed_cu = np.append(self._chunk_starts, self.packed_length).astype(np.int32)
            self._fixed_pos = np.arange(self.packed_length, dtype=np.int64) % self.seq_len

    def assemble(self, frags: Sequence[Fragment], pad_type: int = 0) -> dict:
        """A row (numpy arrays: input_ids, labels, position_ids, type_ids; cu_seqlens int32) from its fragments."""
        P = self.packed_length
        toks = np.zeros(P, dtype=np.int64)
        labels = np.full(P, IGNORE_INDEX, dtype=np.int64)
        type_ids = np.empty(P, dtype=np.int64)
        starts = []
        pos = 0
        last_type = pad_type
        for f in frags:
            n = len(f.tokens)
            if not n:
                continue
            toks[pos:pos + n] = f.tokens
            labels[pos:pos + n - 1] = f.tokens[1:]
            labels[pos + n - 1] = f.last_label
            type_ids[pos:pos + n] = f.type_id
            last_type = f.type_id
            starts.append(pos)
            pos += n
        if pos < P:  # padding
            type_ids[pos:] = last_type
            starts.append(pos)
        labels[labels < 0] = IGNORE_INDEX
        np.abs(toks, out=toks)
        if self.pack_into_one:
            cu, pos_ids = self._fixed_cu, self._fixed_pos.copy()
        else:
            st = np.union1d(np.asarray(starts, dtype=np.int64), self._chunk_starts)
            cu = np.append(st, P).astype(np.int32)
            pos_ids = np.arange(P, dtype=np.int64) - np.repeat(st, np.diff(cu))
        return {"input_ids": toks, "labels": labels, "position_ids": pos_ids, "type_ids": type_ids,
                "cu_seqlens": cu}


def check_vocab(tokens: np.ndarray, vocab_size: Optional[int], where: Callable[[], str], first: int) -> None:
    """DataError naming the document when a token id is outside [0, vocab_size) (negatives: masked ids)."""
    if vocab_size is None or not len(tokens):
        return
    V = vocab_size
    if int(tokens.max()) < V and int(tokens.min()) > -V:
        return
    bad = int(np.nonzero((tokens >= V) | (tokens <= -V))[0][0])
    raise DataError(f"{where()}: token id {int(tokens[bad])} at token {first + bad} is outside the model's "
                    f"vocabulary (model.vocab_size = {V}); was the data tokenized with another tokenizer?")


class Packer:
    """Builds the packed rows of a `DocTable` in the order of an `EpochIndex`."""

    def __init__(self, table, shape: RowShape, vocab_size: Optional[int] = None):
        self.table, self.shape, self.vocab_size = table, shape, vocab_size

    def row(self, epoch, k: int) -> dict:
        """Row k of the epoch (padded past the end of the epoch's tokens)."""
        P = self.shape.packed_length
        table = self.table
        need = max(0, min(P, epoch.total - k * P))
        frags = []
        pad_type = 0
        if need:
            j, off = epoch.row_start(k)
        else:  # a row past the end: all padding, with the type of the last document
            j, off = epoch.num_docs, 0
            for jj in range(epoch.num_docs - 1, -1, -1):
                if table.length(epoch.doc(jj)):
                    pad_type = table.type_of(epoch.doc(jj))
                    break
        where = []
        while need > 0 and j < epoch.num_docs:
            g = epoch.doc(j)
            L = table.length(g)
            if off >= L:
                j, off = j + 1, 0
                continue
            take = min(L - off, need)
            n = min(L, off + take + 1) - off  # one more token: the label of the fragment's last token
            buf = np.empty(n, dtype=np.int64)
            table.read_into(buf, g, off, off + n)
            frags.append(Fragment(buf[:take], table.type_of(g), buf[take] if n > take else IGNORE_INDEX))
            where.append((g, off))
            need -= take
            off += take
            if off >= L:
                j, off = j + 1, 0
        if self.vocab_size is not None and frags:
            V = self.vocab_size
            ids = np.concatenate([f.tokens for f in frags])
            if int(ids.max()) >= V or int(ids.min()) <= -V:  # one check per row; the culprit named when it fails
                for f, (g, first) in zip(frags, where):
                    check_vocab(f.tokens, V, lambda g=g: table.location(g), first)
        return self.shape.assemble(frags, pad_type)
