"""Packing documents into rows of `packed_length` tokens (InternLM's PackedDataset semantics, vectorized).

The documents of a corpus, in a given order, form one token stream; row k is the stream's tokens
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
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from internlm_core.errors import DataError

from .dataset import Corpus

IGNORE_INDEX = -100


class StreamOrder:
    """An order of a corpus's documents and the stream positions it gives them."""

    def __init__(self, corpus: Corpus, order: Optional[np.ndarray]):
        self.order = order  # None: the corpus's own order
        lengths = corpus.lengths if order is None else corpus.lengths[order]
        self.ends = np.cumsum(lengths)  # exclusive end position of the j-th document of the order
        self.total = int(self.ends[-1]) if len(self.ends) else 0

    def doc(self, j: int) -> int:
        return j if self.order is None else int(self.order[j])


class Packer:
    """Builds packed rows of a corpus for a `StreamOrder`."""

    def __init__(self, corpus: Corpus, seq_len: int, packed_length: int, pack_sample_into_one: bool = False,
                 vocab_size: Optional[int] = None):
        if seq_len < 1 or packed_length < 1:
            raise DataError(f"data.seq_len ({seq_len}) and data.packed_length ({packed_length}) must be >= 1")
        self.corpus = corpus
        self.seq_len = int(seq_len)
        self.packed_length = int(packed_length)
        self.pack_into_one = bool(pack_sample_into_one)
        self.vocab_size = vocab_size
        self._chunk_starts = np.arange(0, self.packed_length, self.seq_len, dtype=np.int64)
        if self.pack_into_one:
            cu = np.append(self._chunk_starts, self.packed_length).astype(np.int32)
            self._fixed_cu = cu
            self._fixed_pos = np.arange(self.packed_length, dtype=np.int64) % self.seq_len

    def row(self, order: StreamOrder, k: int) -> dict:
        """Row k of the stream (numpy arrays: input_ids, labels, position_ids, type_ids; cu_seqlens int32)."""
        P = self.packed_length
        s = k * P
        e = min(s + P, order.total)
        if s >= order.total:
            n_real = 0
        else:
            n_real = e - s
        ends = order.ends
        toks = np.empty(P, dtype=np.int64)
        labels = np.empty(P, dtype=np.int64)
        type_ids = np.empty(P, dtype=np.int64)
        frag_starts = []
        corpus = self.corpus
        last_type = 0
        if n_real:
            j = int(np.searchsorted(ends, s, side="right"))
            pos = s
            while pos < e:
                dend = int(ends[j])
                dlen = int(corpus.lengths[order.doc(j)])
                dstart = dend - dlen
                b = min(e, dend)
                a_row, b_row = pos - s, b - s
                d = order.doc(j)
                corpus.read_into(toks[a_row:b_row], d, pos - dstart, b - dstart)
                t = int(corpus.types[d])
                type_ids[a_row:b_row] = t
                last_type = t
                frag_starts.append(a_row)
                if b == dend:  # the document ends inside this row
                    labels[b_row - 1] = IGNORE_INDEX
                else:  # it continues in the next row: the label is its next token
                    nxt = np.empty(1, dtype=np.int64)
                    corpus.read_into(nxt, d, b - dstart, b - dstart + 1)
                    labels[b_row - 1] = nxt[0]
                pos = b
                j += 1
            # labels: the next token, except at document ends (already set above)
            last = labels[n_real - 1]
            ends_in_row = ends[(ends > s) & (ends < e)] - s - 1  # rows positions of document ends, except at e
            labels[: n_real - 1] = toks[1:n_real]
            labels[ends_in_row] = IGNORE_INDEX
            labels[n_real - 1] = last
            if self.vocab_size is not None:
                self._check_vocab(toks[:n_real], frag_starts, order, s)
        if n_real < P:  # padding
            if not n_real and len(order.ends):  # a row past the end: the type of the stream's last document
                last_type = int(corpus.types[order.doc(len(order.ends) - 1)])
            toks[n_real:] = 0
            labels[n_real:] = IGNORE_INDEX
            type_ids[n_real:] = last_type
            frag_starts.append(n_real)
        labels[labels < 0] = IGNORE_INDEX
        np.abs(toks, out=toks)
        if self.pack_into_one:
            cu, pos_ids = self._fixed_cu, self._fixed_pos.copy()
        else:
            starts = np.union1d(np.asarray(frag_starts, dtype=np.int64), self._chunk_starts)
            cu = np.append(starts, P).astype(np.int32)
            pos_ids = np.arange(P, dtype=np.int64) - np.repeat(starts, np.diff(cu))
        return {"input_ids": toks, "labels": labels, "position_ids": pos_ids, "type_ids": type_ids,
                "cu_seqlens": cu}

    def _check_vocab(self, toks: np.ndarray, frag_starts: list, order: StreamOrder, s: int) -> None:
        V = self.vocab_size
        lo, hi = int(toks.min()), int(toks.max())
        if hi < V and lo > -V:
            return
        bad = int(np.nonzero((toks >= V) | (toks <= -V))[0][0])
        fi = int(np.searchsorted(np.asarray(frag_starts), bad, side="right")) - 1
        j = int(np.searchsorted(order.ends, s, side="right")) + fi
        d = order.doc(j)
        dstart = int(order.ends[j] - self.corpus.lengths[d])
        raise DataError(f"{self.corpus.location(d)}: token id {int(toks[bad])} at token {s + bad - dstart} is outside "
                        f"the model's vocabulary (model.vocab_size = {V}); was the data tokenized with another "
                        "tokenizer?")
