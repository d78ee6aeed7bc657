"""Train/valid loaders: exact resume, data-parallel sharding, epochs, dummy data, folders and type ids."""

import io
import os

import numpy as np
import pytest
import torch

from internlm_core.config.schema import DataConfig
from internlm_core.data import build_train_loader, build_valid_loaders
from internlm_core.data.formats import OursWriter
from internlm_core.errors import DataError


def _write(path, docs, vocab):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    w = OursWriter(path, path + ".meta", vocab)
    for d in docs:
        w.write(d)
    w.close()


def _unique_corpus(folder, n_docs=150, seed=0):
    """Documents of random length whose token ids are all distinct (id = position in the whole corpus)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 60, size=n_docs)
    ids = np.arange(int(lens.sum()))
    docs = np.split(ids, np.cumsum(lens)[:-1])
    half = n_docs // 2
    _write(str(folder / "web" / "a.bin"), docs[:half], 10**6)
    _write(str(folder / "code" / "b.bin"), docs[half:], 10**6)
    return int(lens.sum())


def _cfg(**kw):
    base = dict(seq_len=16, micro_bsz=2, packed_length=32, micro_num=2, valid_micro_num=2, seed=3)
    base.update(kw)
    return DataConfig(**base)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _same(b1, b2):
    return (all(torch.equal(b1[k], b2[k]) for k in ("input_ids", "labels", "position_ids", "type_ids"))
            and all(torch.equal(x, y) for x, y in zip(b1["cu_seqlens"], b2["cu_seqlens"])))


@pytest.mark.parametrize("num_worker", [0, 1])
def test_resume_is_exact(tmp_path, num_worker):
    total = _unique_corpus(tmp_path)
    cfg = _cfg(train_folder=str(tmp_path), num_worker=num_worker)
    k = 7
    ref = _take(iter(build_train_loader(cfg, dp_rank=0, dp_size=1, vocab_size=10**6)), k + 200)
    assert 200 * 2 * 32 > 2 * total  # the 200 batches cross at least two epoch boundaries

    first = build_train_loader(cfg, dp_rank=0, dp_size=1, vocab_size=10**6)
    it = iter(first)
    got = _take(it, k)
    sd = first.state_dict()
    _take(it, 5)  # batches after the save are not part of the resumed run
    # plain types only: survives torch.save / weights_only load
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert sd["rows_consumed"] == k * 2

    resumed = build_train_loader(cfg, dp_rank=0, dp_size=1, vocab_size=10**6)
    resumed.load_state_dict(sd)
    got += _take(iter(resumed), 200)
    assert all(_same(a, b) for a, b in zip(ref, got))
    assert not _same(ref[0], ref[1])


def test_two_ranks_split_without_duplicates(tmp_path):
    total = _unique_corpus(tmp_path)
    cfg = _cfg(train_folder=str(tmp_path))
    loaders = [build_train_loader(cfg, dp_rank=r, dp_size=2, vocab_size=10**6) for r in (0, 1)]
    rows_per_epoch = loaders[0].rows_per_epoch
    steps = rows_per_epoch // 4  # 2 ranks x 2 micro-batches per step
    seen = []
    for ld in loaders:
        for b in _take(iter(ld), steps):
            seen.append(b["input_ids"].flatten())
    seen = torch.cat(seen)
    assert len(seen) == steps * 4 * 32
    assert len(torch.unique(seen)) == len(seen)  # no token (hence no sample piece) twice
    assert len(seen) > 0.8 * total
    # rank r's rows of a step are rows [2r, 2r + 2) of the step, as one rank with micro_num 4 sees them
    one = iter(build_train_loader(_cfg(train_folder=str(tmp_path), micro_num=4), dp_rank=0, dp_size=1,
                                  vocab_size=10**6))
    b0, b1 = loaders[0].batch_at(0), loaders[1].batch_at(0)  # the first step of each rank
    b = next(one)
    assert torch.equal(torch.cat([b0["input_ids"], b1["input_ids"]]), b["input_ids"])


def test_resume_with_other_dp_size(tmp_path):
    _unique_corpus(tmp_path)
    two = [iter(build_train_loader(_cfg(train_folder=str(tmp_path)), dp_rank=r, dp_size=2, vocab_size=10**6))
           for r in (0, 1)]
    ld0 = build_train_loader(_cfg(train_folder=str(tmp_path)), dp_rank=0, dp_size=2, vocab_size=10**6)
    it0 = iter(ld0)
    _take(it0, 3)
    sd = ld0.state_dict()
    ref = [torch.cat([a["input_ids"], b["input_ids"]]) for a, b in zip(_take(two[0], 8), _take(two[1], 8))][3:]
    single = build_train_loader(_cfg(train_folder=str(tmp_path), micro_num=4), dp_rank=0, dp_size=1,
                                vocab_size=10**6)
    single.load_state_dict(sd)
    got = [b["input_ids"] for b in _take(iter(single), 5)]
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_epochs_reshuffle_and_seed_changes_order(tmp_path):
    _unique_corpus(tmp_path)
    ld = build_train_loader(_cfg(train_folder=str(tmp_path)), dp_rank=0, dp_size=1, vocab_size=10**6)
    n = ld.rows_per_epoch
    e0 = torch.cat([torch.from_numpy(ld.global_row(g)["input_ids"]) for g in range(n)])
    e1 = torch.cat([torch.from_numpy(ld.global_row(n + g)["input_ids"]) for g in range(n)])
    assert not torch.equal(e0, e1)
    assert len(set(e0.tolist()) & set(e1.tolist())) > 0.9 * len(e0)  # same documents, another order
    other = build_train_loader(_cfg(train_folder=str(tmp_path), seed=4), dp_rank=0, dp_size=1, vocab_size=10**6)
    assert not torch.equal(next(iter(other))["input_ids"], next(iter(ld))["input_ids"])
    again = build_train_loader(_cfg(train_folder=str(tmp_path)), dp_rank=0, dp_size=1, vocab_size=10**6)
    assert torch.equal(next(iter(again))["input_ids"], ld.batch_at(0)["input_ids"])


def test_type_ids_by_subfolder_and_internlm_mode(tmp_path):
    for sub in ("en", "cn", "code"):
        _write(str(tmp_path / sub / "part" / "x.bin"), [[1, 2, 3]] * 20, 100)
    ld = build_train_loader(_cfg(train_folder=str(tmp_path)), dp_rank=0, dp_size=1, vocab_size=100)
    assert ld.type_names == {0: "cn", 1: "code", 2: "en"}  # sorted subfolder names
    ld = build_train_loader(_cfg(train_folder=str(tmp_path), dataset_type_mode="internlm"), dp_rank=0, dp_size=1,
                            vocab_size=100)
    assert ld.type_names == {0: "en", 1: "cn", 2: "code"}
    b = next(iter(ld))
    assert set(b["type_ids"].unique().tolist()) <= {0, 1, 2}
    _write(str(tmp_path / "other" / "y.bin"), [[1, 2]], 100)
    with pytest.raises(DataError, match=r"other/y\.bin: dataset_type_mode='internlm' needs exactly one folder named "
                                        r"en, cn or code"):
        build_train_loader(_cfg(train_folder=str(tmp_path), dataset_type_mode="internlm"), dp_rank=0, dp_size=1,
                           vocab_size=100)


def test_walk_follows_links_once_and_sorted(tmp_path):
    data = tmp_path / "data"
    _write(str(tmp_path / "elsewhere" / "z.bin"), [[5, 6, 7]] * 30, 100)
    _write(str(data / "b" / "y.bin"), [[1, 2, 3]] * 30, 100)
    _write(str(data / "a.bin"), [[8, 9]] * 30, 100)
    os.symlink(tmp_path / "elsewhere", data / "linked")
    os.symlink(data, data / "b" / "loop")  # a cycle must not hang the walk
    from internlm_core.data import find_bin_files
    files = [os.path.relpath(p, data) for p in find_bin_files(str(data))]
    assert files == ["a.bin", "b/y.bin", "linked/z.bin"]
    ld = build_train_loader(_cfg(train_folder=str(data)), dp_rank=0, dp_size=1, vocab_size=100)
    assert ld.type_names == {0: "a", 1: "b", 2: "linked"}


def test_empty_and_missing_train_folder(tmp_path):
    with pytest.raises(DataError, match=rf"data\.train_folder {tmp_path}: no \.bin files found"):
        build_train_loader(_cfg(train_folder=str(tmp_path)), dp_rank=0, dp_size=1, vocab_size=100)
    with pytest.raises(DataError, match=r"nope: no such folder"):
        build_train_loader(_cfg(train_folder=str(tmp_path / "nope")), dp_rank=0, dp_size=1, vocab_size=100)


def test_min_length_leaving_nothing(tmp_path):
    _write(str(tmp_path / "a.bin"), [[1, 2, 3]] * 5, 100)
    with pytest.raises(DataError, match=r"no documents left \(min_length=10\)"):
        build_train_loader(_cfg(train_folder=str(tmp_path), min_length=10), dp_rank=0, dp_size=1, vocab_size=100)


def test_training_time_vocab_check(tmp_path):
    _write(str(tmp_path / "a.bin"), [[1, 2, 3]] * 31 + [[1, 150, 3]], 300)  # 96 tokens: 3 full rows
    ld = build_train_loader(_cfg(train_folder=str(tmp_path)), dp_rank=0, dp_size=1, vocab_size=100)
    it = iter(ld)
    with pytest.raises(DataError, match=r"a\.bin: document 31: token id 150 at token 1 is outside the model's "
                                        r"vocabulary \(model\.vocab_size = 100\)"):
        _take(it, 2)  # 4 rows: the whole epoch


# ------------------------------------------------------------------------------------------------------ dummy data

def test_dummy_fixed_length():
    cfg = _cfg(dummy_num_samples=50, seed=11)
    b = next(iter(build_train_loader(cfg, dp_rank=0, dp_size=1, vocab_size=1000)))
    assert b["type_names"] == {0: "dummy"}
    assert all(c.tolist() == [0, 16, 32] for c in b["cu_seqlens"])
    assert b["position_ids"][0].tolist() == list(range(16)) * 2
    assert b["labels"][0, 15].item() == -100 and b["labels"][0, 14].item() == b["input_ids"][0, 15].item()
    assert 0 <= b["input_ids"].min() and b["input_ids"].max() < 1000
    b2 = next(iter(build_train_loader(cfg, dp_rank=0, dp_size=1, vocab_size=1000)))
    assert torch.equal(b["input_ids"], b2["input_ids"])


def test_dummy_zipf_distribution_and_random_lengths():
    cfg = _cfg(seq_len=512, packed_length=1024, micro_num=8, dummy_num_samples=400, seed=5,
               fixed_random_dataset_seqlen=False, dummy_distribution="zipf")
    ld = build_train_loader(cfg, dp_rank=0, dp_size=1, vocab_size=5000)
    it = iter(ld)
    ids = torch.cat([next(it)["input_ids"].flatten() for _ in range(12)])
    counts = torch.bincount(ids, minlength=5000).double()
    # p(id) ∝ 1/(id+1)^1.1: p0/p1 = 2^1.1 ≈ 2.14, p0/p9 = 10^1.1 ≈ 12.6
    assert abs(counts[0] / counts[1] - 2 ** 1.1) < 0.15
    assert abs(counts[0] / counts[9] - 10 ** 1.1) < 1.5
    b = next(it)
    assert any(len(c) > 3 for c in b["cu_seqlens"])  # random lengths: document boundaries inside rows


# ------------------------------------------------------------------------------------------------------ validation

def test_valid_loaders_split_and_cover_everything(tmp_path):
    _write(str(tmp_path / "valid" / "wiki" / "a.bin"), [list(range(1, 41))] * 3, 100)    # 120 tokens
    _write(str(tmp_path / "valid" / "code" / "b.bin"), [list(range(1, 11))] * 2, 100)    # 20 tokens
    _write(str(tmp_path / "valid" / "c.bin"), [[7, 8, 9]], 100)                           # "val"
    _write(str(tmp_path / "train" / "wiki" / "t.bin"), [[1, 2, 3]] * 30, 100)
    cfg = _cfg(train_folder=str(tmp_path / "train"), valid_folder=str(tmp_path / "valid"), valid_micro_num=1)
    per_rank = [build_valid_loaders(cfg, dp_rank=r, dp_size=2, vocab_size=100) for r in (0, 1)]
    assert sorted(per_rank[0]) == ["code", "val", "wiki"]
    wiki = [list(per_rank[r]["wiki"]) for r in (0, 1)]
    assert len(wiki[0]) == len(wiki[1]) == 2  # 120 tokens → 4 rows of 32 → 2 batches per rank
    real = sum(int((b["labels"] != -100).sum()) for w in wiki for b in w)
    assert real == 3 * 39  # every predicted token exactly once
    assert wiki[0][0]["type_names"] == {0: "wiki"}  # same id as the training type of the same name
    code = [list(per_rank[r]["code"]) for r in (0, 1)]
    assert len(code[0]) == len(code[1]) == 1
    assert int((code[1][0]["labels"] != -100).sum()) == 0  # rank 1 gets a padding batch to stay in step
    code_id = next(iter(code[1][0]["type_names"]))
    assert code_id != 0 and bool((code[1][0]["type_ids"] == code_id).all())
    # re-iterable from the start
    assert _same(list(per_rank[0]["wiki"])[0], wiki[0][0])
    # real training data without valid_folder: no validation
    assert build_valid_loaders(_cfg(train_folder=str(tmp_path / "train")), dp_rank=0, dp_size=1, vocab_size=100) == {}


def test_dummy_training_data_validates_on_held_out_dummy_data():
    cfg = _cfg()
    assert cfg.train_folder is None and cfg.valid_folder is None
    valid = build_valid_loaders(cfg, dp_rank=0, dp_size=2, vocab_size=100)
    assert list(valid) == ["val"]
    batches = list(valid["val"])
    assert len(batches) >= 1 and batches[0]["type_names"] == {0: "dummy"}
    assert int((batches[0]["labels"] != -100).sum()) > 0
    train = next(iter(build_train_loader(cfg, dp_rank=0, dp_size=2, vocab_size=100)))
    assert not torch.equal(train["input_ids"][0], batches[0]["input_ids"][0])  # another seed than training


@pytest.mark.parametrize("num_worker", [0, 2])
def test_load_state_while_iterating(tmp_path, num_worker):
    _unique_corpus(tmp_path)
    cfg = _cfg(train_folder=str(tmp_path), num_worker=num_worker)
    ld = build_train_loader(cfg, dp_rank=0, dp_size=1, vocab_size=10**6)
    it = iter(ld)
    ref = _take(it, 6)
    ld.load_state_dict({"rows_consumed": 4})  # back to step 2 while the iterator (and its prefetch) is open
    again = _take(it, 4)
    assert all(_same(a, b) for a, b in zip(ref[2:], again))
    assert ld.state_dict()["rows_consumed"] == 12


def test_corrupted_token_data_found_by_the_loader(tmp_path, monkeypatch):
    _write(str(tmp_path / "a.bin"), [[1, 2, 3]] * 40, 100)
    data = bytearray((tmp_path / "a.bin").read_bytes())
    data[70] ^= 0x04
    (tmp_path / "a.bin").write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"a\.bin: corrupted \.bin: the token data does not match the checksum"):
        build_train_loader(_cfg(train_folder=str(tmp_path)), dp_rank=0, dp_size=1, vocab_size=100)
    import internlm_core.data.index as ix
    monkeypatch.setattr(ix, "VERIFY_MAX_BYTES", 10)  # a "big" folder: its checksums are not read when it is indexed
    build_train_loader(_cfg(train_folder=str(tmp_path)), dp_rank=0, dp_size=1, vocab_size=100)
