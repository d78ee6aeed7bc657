"""tools/tokenizer.py as a user runs it: InternLM's files byte for byte, folder trees, every bad input."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from internlm_core.data.formats import open_token_file

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "tokenizer.py"
from tests.helpers.fixtures import INTERNLM_FIXTURES as FIX  # noqa: E402

MODEL = str(FIX / "V7_sft.model")


def run(*args, cwd=None):
    p = subprocess.run([sys.executable, str(TOOL), "--quiet", *map(str, args)], capture_output=True, text=True,
                       cwd=cwd, timeout=120)
    return p.returncode, p.stdout, p.stderr


def fails_with(args, message, cwd=None):
    """Exit status 1, one `error: ...` line on stderr containing `message`, no traceback."""
    rc, out, err = run(*args, cwd=cwd)
    assert rc == 1, (rc, out, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert message in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("name", ["txt", "json", "jsonl"])
def test_internlm_format_byte_for_byte(tmp_path, name):
    out = tmp_path / f"corpus_{name}.bin"
    args = ["--text_input_path", FIX / f"corpus.{name}", "--bin_output_path", out, "--tokenizer", MODEL,
            "--format", "internlm"]
    if name != "txt":
        args.append("--internlm-compat")  # InternLM tokenized the JSON syntax of json/jsonl input
    rc, stdout, err = run(*args)
    assert rc == 0, err
    assert out.read_bytes() == (FIX / f"corpus_{name}.bin").read_bytes()
    assert Path(str(out) + ".meta").read_bytes() == (FIX / f"corpus_{name}.bin.meta").read_bytes()
    assert "documents" in stdout and "MB/s" in stdout


def test_text_key_empty_string_is_internlm_compat(tmp_path):
    out = tmp_path / "o.bin"
    rc, _, err = run("--input", FIX / "corpus.jsonl", "--output", out, "--tokenizer", MODEL, "--format", "internlm",
                     "--text-key", "")
    assert rc == 0, err
    assert out.read_bytes() == (FIX / "corpus_jsonl.bin").read_bytes()


def test_default_format_reads_back_same_ids(tmp_path):
    out = tmp_path / "o.bin"
    rc, _, err = run("--input", FIX / "corpus.txt", "--output", out, "--tokenizer", MODEL, "--workers", "2")
    assert rc == 0, err
    ours, theirs = open_token_file(str(out)), open_token_file(str(FIX / "corpus_txt.bin"))
    assert ours.format == "ours" and ours.dtype == np.dtype("<i4") and ours.vocab_size == 103168
    assert ours.num_docs == theirs.num_docs
    assert all(np.array_equal(ours.read(i), theirs.read(i)) for i in range(ours.num_docs))
    assert out.stat().st_size < (FIX / "corpus_txt.bin").stat().st_size


def test_megatron_format_is_read_by_megatron_core(tmp_path):
    out = tmp_path / "m" / "corpus.bin"
    rc, stdout, err = run("--input", FIX / "corpus.txt", "--output", out, "--tokenizer", MODEL, "--format", "megatron")
    assert rc == 0, err
    assert "(+ corpus.idx)" in stdout and (tmp_path / "m" / "corpus.idx").exists()
    ours, theirs = open_token_file(str(out)), open_token_file(str(FIX / "corpus_txt.bin"))
    assert ours.format == "megatron" and ours.dtype == np.dtype("<i4")  # V7's 103168 ids need int32
    assert ours.num_docs == theirs.num_docs
    assert all(np.array_equal(ours.read(i), theirs.read(i)) for i in range(ours.num_docs))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        idx = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    ds = idx.IndexedDataset(str(tmp_path / "m" / "corpus"))
    assert len(ds) == theirs.num_docs and all(ds[i].tolist() == theirs.read(i).tolist() for i in range(len(ds)))


def test_folder_tree_gz_and_mirroring(tmp_path):
    src = tmp_path / "raw"
    (src / "en").mkdir(parents=True)
    (src / "code" / "py").mkdir(parents=True)
    with gzip.open(src / "en" / "a.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.write(json.dumps({"text": "hello"}) + "\n" + json.dumps({"text": "wörld"}) + "\n")
    (src / "code" / "py" / "b.txt").write_text("x = 1\n\n  y = 2  \n", encoding="utf-8")
    (src / "notes.md").write_text("ignored", encoding="utf-8")
    rc, out, err = run("--input", src, "--output", tmp_path / "bin")
    assert rc == 0, err
    a = open_token_file(str(tmp_path / "bin" / "en" / "a.bin"))
    b = open_token_file(str(tmp_path / "bin" / "code" / "py" / "b.bin"))
    assert a.read(1).tolist() == [256] + list("wörld".encode()) + [257]
    assert [b.read(i).tolist() for i in range(2)] == [[256, *b"x = 1", 257], [256, *b"y = 2", 257]]
    assert "tokenized 2 file(s): 4 documents" in out
    assert sorted(os.listdir(tmp_path / "bin" / "en")) == ["a.bin", "a.bin.meta"]  # no temporary files left


# ---------------------------------------------------------------------------------------------------- bad input

def test_malformed_json_line_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "ok"}\n{"text": "broken\n{"text": "fine"}\n', encoding="utf-8")
    fails_with(["--input", p, "--output", tmp_path / "o.bin"], f"{p}:2: malformed JSON at column 17: Invalid control character")
    assert not [f for f in os.listdir(tmp_path) if f.startswith("o.bin")]  # nothing that looks finished, no temps


def test_on_error_skip_counts(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b'{"text": "ok"}\n{"text": "broken\n{"other": 1}\n{"text": "caf\xe9"}\n{"text": "fine"}\n')
    rc, out, err = run("--input", p, "--output", tmp_path / "o.bin", "--on-error", "skip")
    assert rc == 0, err
    assert "skipped 3 (malformed JSON: 1, missing text key: 1, non-UTF-8: 1)" in out
    assert f"skipped: {p}:2: malformed JSON" in err and f"skipped: {p}:4: not valid UTF-8" in err
    assert open_token_file(str(tmp_path / "o.bin")).num_docs == 2


def test_missing_text_key(tmp_path):
    p = tmp_path / "k.jsonl"
    p.write_text('{"content": "abc", "meta": 1}\n', encoding="utf-8")
    fails_with(["--input", p, "--output", tmp_path / "o.bin"],
               f"{p}:1: record has no 'text' field (its fields: 'content', 'meta'; choose one with --text-key)")
    rc, _, err = run("--input", p, "--output", tmp_path / "o.bin", "--text-key", "content")
    assert rc == 0, err


def test_missing_text_key_in_json_list(tmp_path):
    p = tmp_path / "k.json"
    p.write_text('[{"text": "a"}, {"body": "b"}]', encoding="utf-8")
    fails_with(["--input", p, "--output", tmp_path / "o.bin"], f"{p}: record 1: record has no 'text' field")


def test_malformed_json_file(tmp_path):
    p = tmp_path / "m.json"
    p.write_text('[\n {"text": "a"},\n {"text": "b"\n]\n', encoding="utf-8")
    fails_with(["--input", p, "--output", tmp_path / "o.bin"], f"{p}:4: malformed JSON at column 1")


def test_non_utf8(tmp_path):
    p = tmp_path / "n.txt"
    p.write_bytes(b"fine line\nab\xffcd\n")
    fails_with(["--input", p, "--output", tmp_path / "o.bin"], f"{p}:2: not valid UTF-8 (byte 0xff at column 3)")


def test_empty_file_and_folder_and_missing_path(tmp_path):
    (tmp_path / "e.jsonl").write_bytes(b"")
    fails_with(["--input", tmp_path / "e.jsonl", "--output", tmp_path / "o.bin"],
               f"{tmp_path / 'e.jsonl'}: empty file (no documents)")
    (tmp_path / "blank.txt").write_text("\n  \n", encoding="utf-8")
    fails_with(["--input", tmp_path / "blank.txt", "--output", tmp_path / "o.bin"],
               f"{tmp_path / 'blank.txt'}: no documents in it")
    (tmp_path / "empty").mkdir()
    fails_with(["--input", tmp_path / "empty", "--output", tmp_path / "out"],
               f"{tmp_path / 'empty'}: empty folder: no .txt, .json or .jsonl files")
    fails_with(["--input", tmp_path / "nope.jsonl", "--output", tmp_path / "o.bin"],
               f"{tmp_path / 'nope.jsonl'}: no such file or folder")
    fails_with(["--input", tmp_path / "e.jsonl", "--output", tmp_path / "o.bin", "--tokenizer", tmp_path / "x.model"],
               "x.model: no such file")


def test_failure_keeps_previous_output(tmp_path):
    good, bad = tmp_path / "good.txt", tmp_path / "bad.jsonl"
    good.write_text("one\ntwo\n", encoding="utf-8")
    bad.write_text('{"text": "x"}\nnot json\n', encoding="utf-8")
    assert run("--input", good, "--output", tmp_path / "o.bin")[0] == 0
    before = (tmp_path / "o.bin").read_bytes(), (tmp_path / "o.bin.meta").read_bytes()
    fails_with(["--input", bad, "--output", tmp_path / "o.bin"], f"{bad}:2: malformed JSON")
    assert ((tmp_path / "o.bin").read_bytes(), (tmp_path / "o.bin.meta").read_bytes()) == before
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "good.txt", "o.bin", "o.bin.meta"]


def test_output_trains(tmp_path):
    """The tool's output is what the training loader reads."""
    from internlm_core.config.schema import DataConfig
    from internlm_core.data import build_train_loader

    rc, _, err = run("--input", FIX / "corpus.jsonl", "--output", tmp_path / "train" / "py" / "c.bin")
    assert rc == 0, err
    cfg = DataConfig(seq_len=64, micro_bsz=2, packed_length=128, micro_num=2, train_folder=str(tmp_path / "train"),
                     seed=1)
    b = next(iter(build_train_loader(cfg, dp_rank=0, dp_size=1, vocab_size=259)))
    assert b["input_ids"].shape == (2, 128) and b["type_names"] == {0: "py"}
    assert int((b["input_ids"] == 256).sum()) >= 1  # BOS of the byte tokenizer


def test_skip_whole_json_file_and_broken_gz(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.json").write_text('[{"text": "a"},', encoding="utf-8")
    (src / "b.jsonl").write_text('{"text": "b"}\n', encoding="utf-8")
    rc, out, err = run("--input", src, "--output", tmp_path / "out", "--on-error", "skip")
    assert rc == 0, err
    assert "skipped 1 (malformed .json file: 1)" in out
    assert f"{src / 'a.json'}:1: malformed JSON at column 16: Expecting value; a .json file is parsed whole" in err
    assert sorted(os.listdir(tmp_path / "out")) == ["b.bin", "b.bin.meta"]
    (src / "c.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    fails_with(["--input", src / "c.jsonl.gz", "--output", tmp_path / "c.bin"], f"{src / 'c.jsonl.gz'}:1: cannot read")
