"""Mixtures by data.dataset_weights: token shares over 200 steps and over every window, exact resume (also with
another data-parallel size), tokens per type, and the errors for missing, unknown and zero-weight types."""

import os

import numpy as np
import pytest
import torch

from internlm_core.config import load_config
from internlm_core.config.schema import DataConfig
from internlm_core.data import build_train_loader
from internlm_core.data.formats import OursWriter
from internlm_core.data.mixture import Mixture
from internlm_core.errors import ConfigError, DataError


def _write(path, docs, vocab=1000):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    w = OursWriter(path, path + ".meta", vocab)
    for d in docs:
        w.write(d)
    w.close()


@pytest.fixture
def two_types(tmp_path):
    """web: many tokens (ids 1..99), code: few (ids 500..599), so natural shares are far from 0.8/0.2."""
    rng = np.random.default_rng(0)
    _write(str(tmp_path / "web" / "a.bin"), [rng.integers(1, 100, size=int(n)) for n in rng.integers(5, 80, 900)])
    _write(str(tmp_path / "code" / "b.bin"), [rng.integers(500, 600, size=int(n)) for n in rng.integers(5, 80, 20)])
    return tmp_path


def _cfg(folder, **kw):
    base = dict(seq_len=16, micro_bsz=2, packed_length=32, micro_num=2, seed=7, train_folder=str(folder),
                dataset_weights={"web": 0.8, "code": 0.2})
    base.update(kw)
    return DataConfig(**base)


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_weights_hold_over_200_steps_and_every_window(two_types):
    ld = build_train_loader(_cfg(two_types), dp_rank=0, dp_size=1, vocab_size=1000)
    it = iter(ld)
    batches = _take(it, 200)
    ids = torch.cat([b["input_ids"].flatten() for b in batches])
    code = int((ids >= 500).sum())  # every token of a row is of the row's type: count by id ranges
    assert abs(code / len(ids) - 0.2) < 0.02
    per_type = ld.consumed_tokens_per_type()
    assert per_type == {"code": code, "web": len(ids) - code}  # exact, from the schedule
    types = torch.cat([b["type_ids"][:, 0] for b in batches]).numpy()  # one type per row
    code_id = {v: k for k, v in ld.type_names.items()}["code"]
    for w in (5, 50):  # any window of w rows: the share is within one row of 20%
        share = np.convolve(types == code_id, np.ones(w), "valid")
        assert share.min() >= 0.2 * w - 1 and share.max() <= 0.2 * w + 1
    # the code type (far fewer tokens than 20% of 200 steps) ran through several of its own epochs
    i = ld.mixture.types.index(code_id)
    assert ld.mixture.rows_before(400)[i] == 80 > 2 * ld.streams[i].stream.rows_per_epoch


def test_resume_in_the_middle_is_exact_also_with_another_dp_size(two_types):
    ref = _take(iter(build_train_loader(_cfg(two_types), dp_rank=0, dp_size=1, vocab_size=1000)), 40)
    first = build_train_loader(_cfg(two_types), dp_rank=0, dp_size=1, vocab_size=1000)
    it = iter(first)
    _take(it, 17)
    sd = first.state_dict()
    assert sd["dataset_weights"] == {"code": 0.2, "web": 0.8}
    resumed = build_train_loader(_cfg(two_types), dp_rank=0, dp_size=1, vocab_size=1000)
    resumed.load_state_dict(sd)
    got = _take(iter(resumed), 23)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
               for a, b in zip(ref[17:], got))
    assert resumed.consumed_tokens_per_type() == {"code": 40 * 2 * 32 // 5, "web": 40 * 2 * 32 * 4 // 5}
    # two ranks of micro_num 1 take together what one rank of micro_num 2 takes
    two = [build_train_loader(_cfg(two_types, micro_num=1), dp_rank=r, dp_size=2, vocab_size=1000) for r in (0, 1)]
    for ld in two:
        ld.load_state_dict(sd)
    pairs = zip(_take(iter(two[0]), 5), _take(iter(two[1]), 5))
    assert all(torch.equal(torch.cat([a["input_ids"], b["input_ids"]]), r["input_ids"])
               for (a, b), r in zip(pairs, ref[17:22]))


def test_tokens_per_type_without_weights_are_exact(two_types):
    ld = build_train_loader(_cfg(two_types, dataset_weights=None), dp_rank=0, dp_size=1, vocab_size=1000)
    it = iter(ld)
    batches = _take(it, 3 * ld.rows_per_epoch // 2)  # crosses an epoch boundary
    ids = torch.cat([b["input_ids"].flatten() for b in batches])
    assert ld.consumed_tokens_per_type() == {"code": int((ids >= 500).sum()), "web": int((ids < 500).sum())}
    sd = ld.state_dict()
    again = build_train_loader(_cfg(two_types, dataset_weights=None), dp_rank=0, dp_size=1, vocab_size=1000)
    again.load_state_dict(sd)
    more = torch.cat([b["input_ids"].flatten() for b in _take(iter(again), 4)])
    assert again.consumed_tokens_per_type()["code"] == int((ids >= 500).sum()) + int((more >= 500).sum())


def test_schedule_is_a_closed_form():
    m = Mixture({"a": 0.8, "b": 0.2}, {0: "a", 1: "b"}, "here")
    assert m.period == 5 and m.q.tolist() == [4, 1]
    m = Mixture({"x": 3, "y": 1, "z": 2.5}, {0: "x", 1: "y", 2: "z"}, "here")
    seq = [m.locate(g) for g in range(1000)]
    for s in range(3):  # each stream's rows come in order 0, 1, 2, ... without gaps
        assert [r for i, r in seq if i == s] == list(range(sum(1 for i, _ in seq if i == s)))
    assert m.rows_before(777).tolist() == np.bincount([i for i, _ in seq[:777]], minlength=3).tolist()


def test_missing_unknown_and_zero_weights_are_errors(two_types):
    with pytest.raises(DataError, match=r"data\.dataset_weights: no weight for dataset type 'web' of data\.train_folder"):
        build_train_loader(_cfg(two_types, dataset_weights={"code": 1.0}), dp_rank=0, dp_size=1, vocab_size=1000)
    with pytest.raises(DataError, match=r"data\.dataset_weights: unknown dataset type 'wiki'; the types of "
                                        r"data\.train_folder .* are code, web"):
        build_train_loader(_cfg(two_types, dataset_weights={"code": 1, "web": 1, "wiki": 1}), dp_rank=0, dp_size=1,
                           vocab_size=1000)
    with pytest.raises(DataError, match=r"data\.dataset_weights\['code'\]: expected a weight > 0, got 0"):
        build_train_loader(_cfg(two_types, dataset_weights={"code": 0, "web": 1}), dp_rank=0, dp_size=1,
                           vocab_size=1000)
    _write(str(two_types / "tiny" / "c.bin"), [[1, 2, 3]] * 10)
    with pytest.raises(DataError, match=r"data\.dataset_weights\['tiny'\]: dataset type 'tiny' .* has no tokens "
                                        r"\(min_length=4\)"):
        build_train_loader(_cfg(two_types, min_length=4, dataset_weights={"web": 0.7, "code": 0.2, "tiny": 0.1}),
                           dp_rank=0, dp_size=1, vocab_size=1000)


def test_config_checks_weights(tmp_path):
    cfg = tmp_path / "c.py"
    cfg.write_text("data = dict(seq_len=16, dataset_weights=dict(web=0.8, code=-1))\nmodel = dict(vocab_size=300)\n")
    with pytest.raises(ConfigError, match=r"data\.dataset_weights\['code'\]: expected a weight > 0, got -1"):
        load_config(str(cfg))
    cfg.write_text("data = dict(seq_len=16, dataset_weights=[0.8, 0.2])\nmodel = dict(vocab_size=300)\n")
    with pytest.raises(ConfigError, match=r"data\.dataset_weights: expected a dict"):
        load_config(str(cfg))
    cfg.write_text("data = dict(seq_len=16, type='streaming')\nmodel = dict(vocab_size=300)\n")
    with pytest.raises(ConfigError, match=r"data\.type='streaming' needs data\.train_folder"):
        load_config(str(cfg))
