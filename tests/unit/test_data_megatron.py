"""Megatron's indexed format (.bin + .idx) read directly: against files written by megatron-core's own
IndexedDatasetBuilder (an independent writer; a test dependency only), our writer byte-for-byte equal to it, the
training loader's document and token counts, mixing with our format, and corrupted files named."""

import os
import warnings

import numpy as np
import pytest
import torch

from internlm_core.config.schema import DataConfig
from internlm_core.data import build_train_loader, open_token_file
from internlm_core.data.formats import OursWriter
from internlm_core.data.megatron import MegatronTokenFile, MegatronWriter
from internlm_core.errors import DataError


def _mcore():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.datasets.indexed_dataset")


def _docs(n, vocab, seed=0, signed=False):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, size=int(k)) for k in rng.integers(1, 40, size=n)]
    if signed:
        docs[1] = -docs[1]
    return docs


def _mcore_write(prefix, docs, dtype):
    idx = _mcore()
    b = idx.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in docs:
        b.add_document(torch.from_numpy(np.asarray(d, dtype=np.int64)), [len(d)])
    b.finalize(prefix + ".idx")


@pytest.mark.parametrize("dtype,vocab", [(np.uint16, 50000), (np.int32, 150000), (np.int64, 1000), (np.uint8, 200)])
def test_reads_megatron_core_files_exactly(tmp_path, dtype, vocab):
    docs = _docs(57, vocab)
    prefix = str(tmp_path / "m")
    _mcore_write(prefix, docs, dtype)
    f = open_token_file(prefix + ".bin")
    assert isinstance(f, MegatronTokenFile) and f.format == "megatron"
    assert f.dtype == np.dtype(dtype) and f.num_docs == f.document_count == 57
    assert f.lengths.tolist() == [len(d) for d in docs]
    assert all(f.read(i).tolist() == d.tolist() for i, d in enumerate(docs))
    assert f.read(5, 2, 4).tolist() == docs[5][2:4].tolist()
    # megatron-core reads it back the same way (its own reader, for the record)
    ds = _mcore().IndexedDataset(prefix)
    assert len(ds) == 57 and ds[3].tolist() == docs[3].tolist()


def test_our_writer_is_byte_identical_to_megatron_core(tmp_path):
    for dtype, vocab, signed in ((np.uint16, 50000, False), (np.int32, 100000, False), (np.int16, 1000, True)):
        docs = _docs(31, vocab, seed=2, signed=signed)
        _mcore_write(str(tmp_path / "ref"), docs, dtype)
        w = MegatronWriter(str(tmp_path / "ours.bin"), vocab_size=vocab, signed=signed)
        for d in docs:
            w.write(d)
        w.close()
        assert w.dtype == np.dtype(dtype)
        for ext in (".bin", ".idx"):
            assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes(), (dtype, ext)


def test_trains_with_the_counts_its_index_holds_mixed_with_our_format(tmp_path):
    docs = _docs(400, 250, seed=3)
    (tmp_path / "mega").mkdir()
    _mcore_write(str(tmp_path / "mega" / "part"), docs, np.uint16)
    (tmp_path / "ours").mkdir()
    w = OursWriter(str(tmp_path / "ours" / "x.bin"), str(tmp_path / "ours" / "x.bin.meta"), 259)
    for d in docs[:100]:
        w.write(d + 1)
    w.close()
    cfg = DataConfig(seq_len=16, micro_bsz=2, packed_length=32, micro_num=2, seed=1, train_folder=str(tmp_path))
    ld = build_train_loader(cfg, dp_rank=0, dp_size=1, vocab_size=260)
    table = ld.table
    assert [s.format for s in table.sources] == ["megatron", "ours"]
    assert table.num_docs == 400 + 100
    assert table.source_tokens == [sum(map(len, docs)), sum(map(len, docs[:100]))]
    assert ld.type_names == {0: "mega", 1: "ours"}
    # one epoch of rows holds every token of both files but the dropped tail, each exactly once
    rows = [ld.global_row(k) for k in range(ld.rows_per_epoch)]
    got = np.concatenate([r["input_ids"] for r in rows])
    want = np.concatenate(docs + [d + 1 for d in docs[:100]])
    assert len(got) == len(want) // 32 * 32
    assert np.all(np.bincount(got, minlength=260) <= np.bincount(want, minlength=260))
    assert len(want) - len(got) < 32
    types = np.concatenate([r["type_ids"] for r in rows])
    assert abs(int((types == 1).sum()) - sum(map(len, docs[:100]))) < 32


def test_corrupted_megatron_files_are_named(tmp_path):
    prefix = str(tmp_path / "m")
    w = MegatronWriter(prefix + ".bin", vocab_size=300)
    for d in ([1, 2, 3], [4, 5], [6]):
        w.write(d)
    w.close()
    idx = open(prefix + ".idx", "rb").read()
    binary = open(prefix + ".bin", "rb").read()
    with open(prefix + ".bin", "wb") as fh:
        fh.write(binary[:-2])
    with pytest.raises(DataError, match=r"m\.bin: truncated Megatron \.bin: 10 bytes, its m\.idx promises 12"):
        open_token_file(prefix + ".bin")
    with open(prefix + ".bin", "wb") as fh:
        fh.write(binary)
    with open(prefix + ".idx", "wb") as fh:
        fh.write(idx[:-8])
    with pytest.raises(DataError, match=r"m\.idx: truncated \.idx: .* expected .* for 3 sequences and 4 document"):
        open_token_file(prefix + ".bin")
    with open(prefix + ".idx", "wb") as fh:
        fh.write(b"XXIDIDX\x00\x00" + idx[9:])
    with pytest.raises(DataError, match=r"m\.idx: not a Megatron index: bad magic"):
        open_token_file(prefix + ".bin")
    with open(prefix + ".idx", "wb") as fh:
        fh.write(idx[:17] + bytes([7]) + idx[18:])  # dtype code 7: float32
    with pytest.raises(DataError, match=r"m\.idx: dtype code 7 \(float32\) holds no token ids"):
        open_token_file(prefix + ".bin")
    bad = bytearray(idx)
    bad[34 + 12 + 8: 34 + 12 + 16] = np.array([3], "<i8").tobytes()  # second pointer: 3, not 6
    with open(prefix + ".idx", "wb") as fh:
        fh.write(bytes(bad))
    with pytest.raises(DataError, match=r"m\.idx: corrupted \.idx: sequence 1 has pointer 3 and length 2"):
        open_token_file(prefix + ".bin")
    os.remove(prefix + ".idx")
    with pytest.raises(DataError, match=r"m\.bin: unknown or corrupted \.bin: .*no Megatron index"):
        open_token_file(prefix + ".bin")
