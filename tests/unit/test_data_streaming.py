"""Streaming data (data.type="streaming"): jsonl / txt.gz / parquet / Hugging Face datasets folders tokenized on
the fly, packed exactly as the pre-tokenized path packs, exact resume (also with prefetching and another
data-parallel size), mixtures, and errors naming the record."""

import gzip
import json
import os

import numpy as np
import pytest
import torch

from internlm_core.config.schema import DataConfig
from internlm_core.data import DocTable, Packer, RowShape, build_train_loader, open_token_file
from internlm_core.data.index import Stream, build_epoch_in_memory
from internlm_core.data.text2bin import Options, tokenize_paths
from internlm_core.data.tokenizers import load_tokenizer
from internlm_core.errors import DataError

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def _texts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(k))) for k in rng.integers(1, 12, size=n)]


def _jsonl(path, texts):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        for t in texts:
            fh.write(json.dumps({"text": t, "meta": 1}) + "\n")


def _cfg(folder, **kw):
    base = dict(type="streaming", tokenizer_path="byte", seq_len=16, micro_bsz=2, packed_length=32, micro_num=2,
                train_folder=str(folder))
    base.update(kw)
    return DataConfig(**base)


def _take(ld, n):
    it = iter(ld)
    return [next(it) for _ in range(n)]


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in ("input_ids", "labels", "position_ids", "type_ids")) and all(
        torch.equal(x, y) for x, y in zip(a["cu_seqlens"], b["cu_seqlens"]))


def _pretokenized_rows(tmp_path, texts, n_rows):
    """The same texts through tools/tokenizer.py's library and the pre-tokenized packer, in file order."""
    src = tmp_path / "ref" / "t.jsonl"
    _jsonl(str(src), texts)
    tokenize_paths(str(src), str(tmp_path / "ref" / "t.bin"), load_tokenizer("byte"), Options(), progress_bar=False)
    table = DocTable.in_memory([open_token_file(str(tmp_path / "ref" / "t.bin"))], [0], {0: "t"})
    ep = build_epoch_in_memory(Stream(table, [0], (0,), 32, with_types=False, shuffle=False), 0)
    packer = Packer(table, RowShape(16, 32), vocab_size=259)
    return [packer.row(ep, k) for k in range(n_rows)]


def test_jsonl_rows_equal_the_pretokenized_path(tmp_path):
    texts = _texts(200)
    _jsonl(str(tmp_path / "data" / "part0.jsonl"), texts[:120])
    _jsonl(str(tmp_path / "data" / "part1.jsonl"), texts[120:])
    ld = build_train_loader(_cfg(tmp_path / "data"), dp_rank=0, dp_size=1, vocab_size=300)
    batches = _take(ld, 20)
    ref = _pretokenized_rows(tmp_path, texts, 40)
    got = [{k: v[m].numpy() if k != "cu_seqlens" else v[m].numpy() for k, v in b.items() if k != "type_names"}
           for b in batches for m in range(2)]
    for r, g in zip(ref, got):
        for k in ("input_ids", "labels", "position_ids", "cu_seqlens"):
            assert np.array_equal(r[k], g[k]), k
    total = sum(len(t.encode()) + 2 for t in texts)
    assert ld.consumed_tokens_per_type() == {"part0": 20 * 64, "part1": 0} and 20 * 64 < total


@pytest.mark.parametrize("num_worker", [0, 1])
def test_resume_is_exact_from_the_position_in_each_source(tmp_path, num_worker):
    texts = _texts(100, seed=1)
    os.makedirs(tmp_path / "d")
    with gzip.open(tmp_path / "d" / "a.txt.gz", "wt") as fh:  # a gzip file: resumed by reading past its records
        fh.write("\n".join(texts[:50]) + "\n")
    _jsonl(str(tmp_path / "d" / "b.jsonl"), texts[50:])
    cfg = _cfg(tmp_path / "d", num_worker=num_worker)
    ref = _take(build_train_loader(cfg, dp_rank=0, dp_size=1, vocab_size=300), 60)  # crosses the end: epoch 2
    first = build_train_loader(cfg, dp_rank=0, dp_size=1, vocab_size=300)
    it = iter(first)
    [next(it) for _ in range(40)]
    sd = json.loads(json.dumps(first.state_dict()))  # plain types only
    assert sd["rows_consumed"] == 80 and sd["streams"][0]["source"] == 1 and sd["streams"][0]["offset"] > 0
    assert sum(len(t.encode()) + 2 for t in texts) < 60 * 64  # the reference crosses into the second epoch
    resumed = build_train_loader(cfg, dp_rank=0, dp_size=1, vocab_size=300)
    resumed.load_state_dict(sd)
    got = _take(resumed, 20)
    assert all(_same(a, b) for a, b in zip(ref[40:], got))
    ids = torch.cat([b["type_ids"].flatten() for b in ref])
    assert resumed.consumed_tokens_per_type() == {"a": int((ids == 0).sum()), "b": int((ids == 1).sum())}
    # two ranks with one micro-batch each continue with the same rows
    two = [build_train_loader(_cfg(tmp_path / "d", micro_num=1), dp_rank=r, dp_size=2, vocab_size=300) for r in (0, 1)]
    for ld in two:
        ld.load_state_dict(sd)
    pairs = zip(_take(two[0], 5), _take(two[1], 5))
    assert all(torch.equal(torch.cat([a["input_ids"], b["input_ids"]]), r["input_ids"])
               for (a, b), r in zip(pairs, ref[40:45]))


def _parquet(path, texts, group):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"id": list(range(len(texts))), "content": texts}), path, row_group_size=group)


def _hf_folder(folder, texts):
    """A folder as `datasets.Dataset.save_to_disk` writes it: arrow stream files listed in state.json."""
    pa = pytest.importorskip("pyarrow")
    os.makedirs(folder)
    half = len(texts) // 2
    files = []
    for i, part in enumerate((texts[:half], texts[half:])):
        name = f"data-{i:05d}-of-00002.arrow"
        table = pa.table({"content": part})
        with pa.OSFile(os.path.join(folder, name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            for batch in table.to_batches(max_chunksize=9):
                w.write_batch(batch)
        files.append({"filename": name})
    with open(os.path.join(folder, "state.json"), "w") as fh:
        json.dump({"_data_files": files, "_fingerprint": "x", "_split": "train"}, fh)
    with open(os.path.join(folder, "dataset_info.json"), "w") as fh:
        json.dump({"features": {"content": {"dtype": "string", "_type": "Value"}}}, fh)


def test_parquet_and_hf_folders_mixed_by_weight(tmp_path):
    texts = _texts(300, seed=2)
    os.makedirs(tmp_path / "d" / "pq")
    _parquet(str(tmp_path / "d" / "pq" / "x.parquet"), texts[:150], group=11)
    _hf_folder(str(tmp_path / "d" / "hf"), texts[150:])
    cfg = _cfg(tmp_path / "d", content_name="content", dataset_weights={"pq": 3, "hf": 1})
    ld = build_train_loader(cfg, dp_rank=0, dp_size=1, vocab_size=300)
    batches = _take(ld, 40)
    assert ld.type_names == {0: "hf", 1: "pq"}
    per = ld.consumed_tokens_per_type()
    assert per == {"pq": 60 * 32, "hf": 20 * 32}
    types = torch.cat([b["type_ids"].flatten() for b in batches])
    assert int((types == 1).sum()) == 60 * 32
    # each type's stream starts with its first record: BOS, the UTF-8 bytes of the text, EOS
    first_pq = next(b["input_ids"][m] for b in batches for m in range(2) if int(b["type_ids"][m, 0]) == 1)
    expect = ([256] + list(texts[0].encode()) + [257])[:32]
    assert first_pq[: len(expect)].tolist() == expect
    first_hf = next(b["input_ids"][m] for b in batches for m in range(2) if int(b["type_ids"][m, 0]) == 0)
    expect = ([256] + list(texts[150].encode()) + [257])[:32]
    assert first_hf[: len(expect)].tolist() == expect
    sd = ld.state_dict()
    again = build_train_loader(cfg, dp_rank=0, dp_size=1, vocab_size=300)
    again.load_state_dict(sd)
    ref = build_train_loader(cfg, dp_rank=0, dp_size=1, vocab_size=300)
    assert all(_same(a, b) for a, b in zip(_take(ref, 50)[40:], _take(again, 10)))


def test_errors_name_the_record(tmp_path):
    _jsonl(str(tmp_path / "d" / "a.jsonl"), ["fine"])
    with open(tmp_path / "d" / "a.jsonl", "a") as fh:
        fh.write(json.dumps({"body": "no text field"}) + "\n")
    with pytest.raises(DataError, match=r"a\.jsonl:2: expected a record with a 'text' field \(data\.content_name\)"):
        next(iter(build_train_loader(_cfg(tmp_path / "d"), dp_rank=0, dp_size=1, vocab_size=300)))
    with pytest.raises(DataError, match=r"missing: no such folder"):
        build_train_loader(_cfg(tmp_path / "missing"), dp_rank=0, dp_size=1, vocab_size=300)
    (tmp_path / "d" / "notes.md").write_text("x")
    os.remove(tmp_path / "d" / "a.jsonl")
    with pytest.raises(DataError, match=r"d: no streaming sources \(\.jsonl, \.txt, \.parquet"):
        build_train_loader(_cfg(tmp_path / "d"), dp_rank=0, dp_size=1, vocab_size=300)
    os.makedirs(tmp_path / "e")
    (tmp_path / "e" / "x.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"no documents"):
        next(iter(build_train_loader(_cfg(tmp_path / "e"), dp_rank=0, dp_size=1, vocab_size=300)))
