"""On-disk formats: InternLM's fixtures read exactly, our format round-trips, every corruption is named."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from internlm_core.data.formats import (HEADER_SIZE, InternLMWriter, OursWriter, dtype_for, open_token_file)
from internlm_core.errors import DataError

from tests.helpers.fixtures import INTERNLM_FIXTURES as FIX

NAMES = ["txt", "json", "jsonl"]


def _fixture_tokens(name):
    with open(FIX / f"corpus_{name}.bin", "rb") as fh:
        return [json.loads(line)["tokens"] for line in fh]


@pytest.mark.parametrize("name", NAMES)
def test_reader_loads_internlm_fixtures_exactly(name):
    f = open_token_file(str(FIX / f"corpus_{name}.bin"))
    expected = _fixture_tokens(name)
    meta = np.load(FIX / f"corpus_{name}.bin.meta")
    assert f.format == "internlm"
    assert f.num_docs == len(expected) == meta.shape[0]
    assert f.lengths.tolist() == meta[:, 1].tolist()
    for i, toks in enumerate(expected):
        assert f.read(i).tolist() == toks
    # partial reads (what packing does)
    assert f.read(3, 2, 5).tolist() == expected[3][2:5]
    out = np.empty(4, dtype=np.int64)
    f.read_into(out, 7, 1, 5)
    assert out.tolist() == expected[7][1:5]


def _write(tmp_path, docs, vocab, signed=False, name="a"):
    w = OursWriter(str(tmp_path / f"{name}.bin"), str(tmp_path / f"{name}.bin.meta"), vocab, signed=signed)
    for d in docs:
        w.write(d)
    w.close()
    return tmp_path / f"{name}.bin"


@pytest.mark.parametrize("vocab,signed,dtype", [(259, False, "uint16"), (65536, False, "uint16"),
                                                (103168, False, "int32"), (259, True, "int16"),
                                                (50000, True, "int32")])
def test_ours_roundtrip_and_width(tmp_path, vocab, signed, dtype):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab, size=n).tolist() for n in (1, 5, 300, 2)]
    if signed:
        docs[1] = [-x for x in docs[1]]
    p = _write(tmp_path, docs, vocab, signed)
    assert dtype_for(vocab, signed).name == dtype
    f = open_token_file(str(p))
    assert f.format == "ours" and f.dtype.name == dtype and f.vocab_size == vocab
    assert os.path.getsize(p) == HEADER_SIZE + sum(map(len, docs)) * np.dtype(dtype).itemsize
    assert [f.read(i).tolist() for i in range(f.num_docs)] == docs


def test_ours_writer_rejects_ids_outside_vocab(tmp_path):
    w = OursWriter(str(tmp_path / "a.bin"), str(tmp_path / "a.bin.meta"), 259)
    with pytest.raises(DataError, match=r"a\.bin: token id 300 does not fit the vocabulary of 259 ids"):
        w.write([1, 300])
    with pytest.raises(DataError, match="negative ids need a signed file"):
        w.write([-5])


def test_internlm_writer_matches_internlm_layout(tmp_path):
    docs = [[1, 5, 2], [1, 2], [1, 9, 9, 9, 2]]
    w = InternLMWriter(str(tmp_path / "a.bin"), str(tmp_path / "a.bin.meta"))
    for d in docs:
        w.write(d)
    w.close()
    lines = (tmp_path / "a.bin").read_bytes().splitlines(keepends=True)
    assert lines[0] == b'{"tokens": [1, 5, 2]}\n'
    meta = np.load(tmp_path / "a.bin.meta")
    assert meta.dtype == np.int32 and meta.tolist() == [[0, 3], [len(lines[0]), 2], [len(lines[0]) + len(lines[1]), 5]]
    f = open_token_file(str(tmp_path / "a.bin"))
    assert [f.read(i).tolist() for i in range(3)] == docs


# ---------------------------------------------------------------------------------------------- corruption: ours

@pytest.fixture
def ours(tmp_path):
    return _write(tmp_path, [[1, 2, 3], [4, 5], [6, 7, 8, 9]], 259)


def test_ours_truncated_bin(ours):
    data = ours.read_bytes()
    ours.write_bytes(data[:-2])
    with pytest.raises(DataError, match=rf"^{ours}: truncated \.bin: {len(data) - 2} bytes, the header promises "
                                        rf"{len(data)} \(9 tokens of 2 bytes\)$"):
        open_token_file(str(ours))


def test_ours_bin_shorter_than_header(ours):
    ours.write_bytes(ours.read_bytes()[:20])
    with pytest.raises(DataError, match=r"truncated \.bin: 20 bytes, shorter than the 64-byte header"):
        open_token_file(str(ours))


def test_ours_trailing_bytes(ours):
    ours.write_bytes(ours.read_bytes() + b"\0\0\0\0")
    with pytest.raises(DataError, match=r"corrupted \.bin: .* \(4 trailing bytes\)"):
        open_token_file(str(ours))


def test_ours_bad_magic_is_unknown_format(ours):
    data = bytearray(ours.read_bytes())
    data[1] = ord("X")
    ours.write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"^{ours}: unknown or corrupted \.bin"):
        open_token_file(str(ours))


def test_ours_corrupted_header_width(ours):
    data = bytearray(ours.read_bytes())
    data[10] = 3  # itemsize
    ours.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"corrupted \.bin header: token width 3 bytes"):
        open_token_file(str(ours))


def test_ours_missing_meta(ours):
    os.remove(str(ours) + ".meta")
    with pytest.raises(DataError, match=r"a\.bin\.meta: missing \(every \.bin needs its \.bin\.meta index\)"):
        open_token_file(str(ours))


def test_ours_truncated_meta(ours):
    meta = Path(str(ours) + ".meta")
    meta.write_bytes(meta.read_bytes()[:-8])
    with pytest.raises(DataError, match=r"a\.bin\.meta: truncated \.bin\.meta: 88 bytes, expected 96 for 3 documents"):
        open_token_file(str(ours))


def test_ours_meta_of_another_bin(tmp_path, ours):
    other = _write(tmp_path, [[1, 2, 3], [4, 5], [6, 7, 8, 9]], 259, name="b")  # same shape, other file
    shutil.copy(str(other) + ".meta", str(ours) + ".meta")
    with pytest.raises(DataError, match=r"a\.bin\.meta: does not match .*a\.bin .*same file id: False"):
        open_token_file(str(ours))


def test_ours_meta_offsets_corrupted(ours):
    meta = Path(str(ours) + ".meta")
    data = bytearray(meta.read_bytes())
    data[HEADER_SIZE + 8: HEADER_SIZE + 16] = np.array([7], "<i8").tobytes()  # offsets 0, 7, 5, 9, ...
    meta.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"corrupted \.bin\.meta: document offsets are not increasing from 0 to 9"):
        open_token_file(str(ours))


# ------------------------------------------------------------------------------------------ corruption: InternLM

@pytest.fixture
def ilm(tmp_path):
    for ext in ("", ".meta"):
        shutil.copy(FIX / f"corpus_txt.bin{ext}", tmp_path / f"c.bin{ext}")
    return tmp_path / "c.bin"


def test_internlm_truncated_bin(ilm):
    ilm.write_bytes(ilm.read_bytes()[:-10])
    with pytest.raises(DataError, match=r"c\.bin: truncated InternLM \.bin: the last line has no newline"):
        open_token_file(str(ilm))


def test_internlm_meta_of_another_bin(ilm):
    shutil.copy(FIX / "corpus_json.bin.meta", str(ilm) + ".meta")
    with pytest.raises(DataError, match=r"c\.bin\.meta: does not match .*c\.bin"):
        open_token_file(str(ilm))


def test_internlm_meta_length_wrong(ilm):
    meta = np.load(str(ilm) + ".meta")
    meta[5, 1] += 1
    with open(str(ilm) + ".meta", "wb") as fh:
        np.save(fh, meta)
    f = open_token_file(str(ilm))
    f.read(4)
    with pytest.raises(DataError, match=rf"c\.bin: line 6: has {meta[5, 1] - 1} tokens, but .*c\.bin\.meta says "
                                        rf"{meta[5, 1]} \(meta does not match bin\)"):
        f.read(5)


def test_internlm_corrupted_meta(ilm):
    Path(str(ilm) + ".meta").write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(DataError, match=r"c\.bin\.meta: corrupted or truncated \.bin\.meta \(not a readable \.npy"):
        open_token_file(str(ilm))


def test_internlm_truncated_meta(ilm):
    meta = Path(str(ilm) + ".meta")
    meta.write_bytes(meta.read_bytes()[:-16])
    with pytest.raises(DataError, match=r"c\.bin\.meta: corrupted or truncated \.bin\.meta"):
        open_token_file(str(ilm))


def test_internlm_corrupted_line(ilm):
    data = bytearray(ilm.read_bytes())
    start = int(np.load(str(ilm) + ".meta")[2, 0])
    data[start + 14] = ord("x")  # inside the token list of line 3
    ilm.write_bytes(bytes(data))
    f = open_token_file(str(ilm))
    with pytest.raises(DataError, match=r"c\.bin: line 3: corrupted: not valid JSON"):
        f.read(2)


def test_empty_and_missing_bin(tmp_path):
    (tmp_path / "e.bin").write_bytes(b"")
    with pytest.raises(DataError, match=r"e\.bin: empty \.bin file"):
        open_token_file(str(tmp_path / "e.bin"))
    with pytest.raises(DataError, match=r"nope\.bin: no such file"):
        open_token_file(str(tmp_path / "nope.bin"))


def test_ours_corrupted_token_data_fails_checksum(ours):
    data = bytearray(ours.read_bytes())
    data[HEADER_SIZE + 4] ^= 0x01  # flip one bit of a token id: same size, same header
    ours.write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"^{ours}: corrupted \.bin: the token data does not match the checksum in "
                                        r"its \.bin\.meta"):
        open_token_file(str(ours))


def test_verify_command(tmp_path, ours, capsys):
    from internlm_core.data.verify import main as _main
    assert _main([str(tmp_path)]) == 0
    assert f"ok  {ours}: ours, 3 documents, 9 tokens" in capsys.readouterr().out
    Path(str(ours) + ".meta").write_bytes(b"")
    assert _main([str(ours)]) == 1
    assert "truncated .bin.meta: 0 bytes" in capsys.readouterr().err


def test_data_modules_import_one_another_without_a_circle():
    """formats.py once imported dataset.py (its verify command) while dataset.py imported formats.py."""
    import ast

    pkg = Path(__file__).resolve().parents[2] / "internlm_core" / "data"
    graph = {}
    for f in pkg.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                deps.add(node.module.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("internlm_core.data."):
                deps.add(node.module.split(".")[2])
        graph[f.stem] = deps - {f.stem}
    assert "dataset" not in graph["formats"] and graph["formats"] >= {"megatron", "tokenfile"}

    def reaches(a, b, seen=()):
        return any(d == b or (d not in seen and reaches(d, b, seen + (d,))) for d in graph.get(a, ()))

    circles = [m for m in graph if m != "__init__" and reaches(m, m)]
    assert circles == []
