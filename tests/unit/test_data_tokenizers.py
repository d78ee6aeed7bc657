"""Tokenizers and text extraction: InternLM's ids for every fixture document, byte and HF tokenizers."""

import json

import numpy as np
import pytest
import sentencepiece as spm

from internlm_core.data.formats import open_token_file
from internlm_core.data.text2bin import Options, iter_documents, tokenize_paths, _Skipper, Stats
from internlm_core.data.tokenizers import ByteTokenizer, load_tokenizer

from tests.helpers.fixtures import INTERNLM_FIXTURES as FIX

MODEL = str(FIX / "V7_sft.model")


def _fixture_tokens(name):
    with open(FIX / f"corpus_{name}.bin", "rb") as fh:
        return [json.loads(line)["tokens"] for line in fh]


def _docs(path, text_key):
    opts = Options(text_key=text_key)
    return list(iter_documents(str(path), opts, _Skipper(opts, Stats(), print)))


@pytest.fixture(scope="module")
def v7():
    return load_tokenizer(MODEL, internlm_compat=True)


@pytest.mark.parametrize("name", ["txt", "json", "jsonl"])
def test_internlm_ids_for_every_fixture_document(v7, name):
    docs = _docs(FIX / f"corpus.{name}", None)  # InternLM's documents: raw lines / json.dumps'd records
    expected = _fixture_tokens(name)
    assert len(docs) == len(expected)
    got = [[v7.bos_id] + list(ids) + [v7.eos_id] for ids in v7.encode_batch(docs, threads=2)]
    assert got == expected


def test_text_key_extracts_the_field_not_the_json(v7):
    docs = _docs(FIX / "corpus.jsonl", "text")
    records = [json.loads(line) for line in open(FIX / "corpus.jsonl", encoding="utf-8")]
    assert docs == [r["text"] for r in records]
    sp = spm.SentencePieceProcessor(model_file=MODEL)
    assert v7.encode_batch(docs[:5]) == [sp.encode(r["text"]) for r in records[:5]]
    assert v7.encode_batch(docs[:1]) != _fixture_tokens("jsonl")[0][1:-1]  # InternLM tokenized the JSON syntax


def test_compat_splits_special_token_text_like_hf(v7):
    sp = spm.SentencePieceProcessor(model_file=MODEL)
    assert v7.encode("hello</s>world") == sp.encode("hello") + [2] + sp.encode("world")
    plain = load_tokenizer(MODEL)
    assert plain.encode("hello</s>world") == sp.encode("hello</s>world")


def test_compat_jsonl_reads_lines_like_text_mode(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"text": "a"}\r\n{"text": "b\\r"}\rtail\n')
    assert _docs(p, None) == ['{"text": "a"}\n', '{"text": "b\\r"}\n', "tail\n"]


def test_byte_tokenizer():
    t = ByteTokenizer()
    assert (t.vocab_size, t.bos_id, t.eos_id, t.pad_id) == (259, 256, 257, 258)
    text = "héllo, 世界"
    (ids,) = t.encode_batch([text])
    assert ids.tolist() == list(text.encode("utf-8"))
    assert t.decode(ids) == text


def test_tokenize_paths_with_byte_tokenizer_roundtrips(tmp_path):
    texts = ["first document", "", "ü second\nwith a newline", "third"]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)) + "\n", encoding="utf-8")
    stats = tokenize_paths(str(src), str(tmp_path / "out.bin"), ByteTokenizer(), Options(), progress_bar=False)
    assert stats.docs == 3 and stats.empty_texts == 1
    f = open_token_file(str(tmp_path / "out.bin"))
    assert f.format == "ours" and f.dtype == np.dtype("<u2") and f.vocab_size == 259
    got = [f.read(i).tolist() for i in range(f.num_docs)]
    assert got == [[256] + list(t.encode()) + [257] for t in texts if t]
    assert stats.tokens == sum(len(g) for g in got)


def test_hf_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20,
                            trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = load_tokenizer(str(tmp_path))  # a folder holding tokenizer.json
    assert (hf.bos_id, hf.eos_id) == (1, 2)
    src = tmp_path / "a.txt"
    src.write_text("the lazy fox\n\nquick dog\n", encoding="utf-8")
    tokenize_paths(str(src), str(tmp_path / "a.bin"), hf, Options(add_eos=False), progress_bar=False)
    f = open_token_file(str(tmp_path / "a.bin"))
    assert [f.read(i).tolist() for i in range(2)] == [[1] + tok.encode("the lazy fox").ids,
                                                      [1] + tok.encode("quick dog").ids]


def test_progress_line():
    import io

    from internlm_core.data.text2bin import Progress

    out = io.StringIO()
    p = Progress(2_000_000, stream=out, interval=0.0, force=True)
    p.update(1_000_000, 10, 1234)
    p.close()
    text = out.getvalue()
    assert text.startswith("\rtokenizing: 1.0/2.0 MB (50%), 10 documents, 1,234 tokens, ") and text.endswith("\n")
    assert "MB/s" in text
    quiet = io.StringIO()
    Progress(10, stream=quiet).update(5, 1, 1)  # not a terminal: silent
    assert quiet.getvalue() == ""
