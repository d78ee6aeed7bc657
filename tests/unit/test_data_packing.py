"""Packing checked against hand-built rows (cu_seqlens, labels, positions, type_ids)."""

import numpy as np
import pytest
import torch

from internlm_core.data import DocTable, Packer, RowShape, collate
from internlm_core.data.formats import OursWriter, open_token_file
from internlm_core.data.index import Stream, build_epoch_in_memory
from internlm_core.errors import DataError

A, B, C, D = [1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [11, -12, 13, 14, 15, 16, 17]


def _file(tmp_path, name, docs, vocab=300):
    w = OursWriter(str(tmp_path / f"{name}.bin"), str(tmp_path / f"{name}.bin.meta"), vocab, signed=True)
    for d in docs:
        w.write(d)
    w.close()
    return open_token_file(str(tmp_path / f"{name}.bin"))


@pytest.fixture
def corpus(tmp_path):
    # source 0 ("x", type 5) holds A and C; source 1 ("y", type 7) holds B and D
    return DocTable.in_memory([_file(tmp_path, "x", [A, C]), _file(tmp_path, "y", [B, D])], [5, 7],
                              {5: "x", 7: "y"})


def _packer(table, into_one=False, vocab=300):
    return Packer(table, RowShape(seq_len=4, packed_length=8, pack_sample_into_one=into_one), vocab_size=vocab)


def _epoch(table, order=None):
    """The whole stream in `order` (global document ids; None: the table's order), the tail row kept."""
    return build_epoch_in_memory(Stream(table, list(range(len(table.sources))), (0,), 8, with_types=False,
                                        keep_tail=True, shuffle=False, fixed_order=order), 0)


def _rows(corpus, order, n, into_one=False, vocab=300):
    p = _packer(corpus, into_one, vocab)
    o = _epoch(corpus, np.asarray(order))
    return [{k: v.tolist() for k, v in p.row(o, k).items()} for k in range(n)]


def test_hand_built_rows(corpus):
    # order A, B, C, D (global ids: A=0, C=1, B=2, D=3); stream: 1 2 3 | 4 5 6 7 8 | 9 10 | 11 -12 13 ... 17
    r0, r1, r2 = _rows(corpus, [0, 2, 1, 3], 3)
    assert r0 == {
        "input_ids":    [1, 2, 3, 4, 5, 6, 7, 8],
        "labels":       [2, 3, -100, 5, 6, 7, 8, -100],
        "position_ids": [0, 1, 2, 0, 0, 1, 2, 3],   # restart at B (3) and at the seq_len multiple 4
        "type_ids":     [5, 5, 5, 7, 7, 7, 7, 7],
        "cu_seqlens":   [0, 3, 4, 8],
    }
    assert r1 == {
        "input_ids":    [9, 10, 11, 12, 13, 14, 15, 16],    # abs() of the masked -12
        "labels":       [10, -100, -100, 13, 14, 15, 16, 17],  # C ends; target -12 is masked; D continues (17)
        "position_ids": [0, 1, 0, 1, 0, 1, 2, 3],
        "type_ids":     [5, 5, 7, 7, 7, 7, 7, 7],
        "cu_seqlens":   [0, 2, 4, 8],
    }
    # the stream's tail (what validation sees): D's last token, then padding as a segment of its own
    assert r2 == {
        "input_ids":    [17, 0, 0, 0, 0, 0, 0, 0],
        "labels":       [-100] * 8,
        "position_ids": [0, 0, 1, 2, 0, 1, 2, 3],
        "type_ids":     [7] * 8,
        "cu_seqlens":   [0, 1, 4, 8],
    }


def test_pack_sample_into_one(corpus):
    r0, r1 = _rows(corpus, [0, 2, 1, 3], 2, into_one=True)
    assert r0["cu_seqlens"] == r1["cu_seqlens"] == [0, 4, 8]
    assert r0["position_ids"] == r1["position_ids"] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert r1["labels"] == [10, -100, -100, 13, 14, 15, 16, 17]
    assert r1["input_ids"] == [9, 10, 11, 12, 13, 14, 15, 16]


def test_document_longer_than_row_and_seq_len(tmp_path):
    long_doc = list(range(1, 21))  # 20 tokens: rows of 8, seq_len 4 → segments of 4 inside the document
    c = DocTable.in_memory([_file(tmp_path, "l", [long_doc])], [0], {0: "l"})
    p = _packer(c)
    o = _epoch(c)
    r0, r1 = p.row(o, 0), p.row(o, 1)
    assert r0["cu_seqlens"].tolist() == [0, 4, 8] and r1["cu_seqlens"].tolist() == [0, 4, 8]
    assert r0["labels"].tolist() == list(range(2, 10))   # the label of the row's last token is the next row's first
    assert r1["input_ids"].tolist() == list(range(9, 17))
    assert r0["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]


def test_collate_batch_types(corpus):
    p = _packer(corpus)
    o = _epoch(corpus, np.array([0, 2, 1, 3]))
    b = collate([p.row(o, 0), p.row(o, 1)], corpus.type_names)
    assert b["input_ids"].dtype == b["labels"].dtype == b["position_ids"].dtype == b["type_ids"].dtype == torch.int64
    assert b["input_ids"].shape == (2, 8)
    assert [c.dtype for c in b["cu_seqlens"]] == [torch.int32, torch.int32]
    assert b["cu_seqlens"][1].tolist() == [0, 2, 4, 8]
    assert b["type_names"] == {5: "x", 7: "y"}


def test_min_length_drops_short_documents(tmp_path):
    c = DocTable.in_memory([_file(tmp_path, "x", [A, B, C, D])], [0], {0: "x"}, min_length=4)
    assert c.lengths.tolist() == [0, 5, 0, 7]  # shorter documents keep their id, with no tokens: packing skips them
    assert c.num_tokens == 12
    r0 = _packer(c).row(_epoch(c), 0)
    assert r0["input_ids"].tolist() == [4, 5, 6, 7, 8, 11, 12, 13] and r0["cu_seqlens"].tolist() == [0, 4, 5, 8]


def test_token_id_outside_vocab_names_file_and_document(tmp_path):
    c = DocTable.in_memory([_file(tmp_path, "v", [A, [1, 2, 299, 4], C], vocab=300)], [0], {0: "v"})
    p = _packer(c, vocab=100)
    with pytest.raises(DataError, match=r"v\.bin: document 1: token id 299 at token 2 is outside the model's "
                                        r"vocabulary \(model\.vocab_size = 100\)"):
        p.row(_epoch(c), 0)
    with pytest.raises(DataError, match=r"w\.bin: document 1: token id -250 .* outside"):
        c2 = DocTable.in_memory([_file(tmp_path, "w", [A, [1, 2, -250, 4]], vocab=300)], [0], {0: "w"})
        _packer(c2, vocab=100).row(_epoch(c2), 0)
