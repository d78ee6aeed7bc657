"""Evaluation during training (data/eval_tasks.py, trainer/evaluation.py): lm-eval's tokenization of (context,
choice), packed requests scored as each request alone, lm-eval's acc / acc_norm, task file and config errors."""

import json

import pytest
import torch

from internlm_core.config import build_config
from internlm_core.data.eval_tasks import (ChoiceDoc, EvalTask, build_requests, choice_metrics, deal_batches,
                                           encode_pair, make_batch, pack_rows, read_task)
from internlm_core.data.tokenizers import BYTE_BOS, ByteTokenizer
from internlm_core.errors import ConfigError, DataError
from internlm_core.loss import FlashGPTLMLoss
from internlm_core.model import build_model
from internlm_core.trainer.evaluation import TaskEvaluator

SEQ_LEN = 32
DOCS = (ChoiceDoc("The sky is", ("blue", "green", "made of cheese"), 0),
        ChoiceDoc("2 + 2 = ", ("4", "five"), 0),  # a trailing space: it moves to the continuation
        # 27 + 2 context tokens and a 7-token continuation: left-truncated to seq_len + 1 tokens
        ChoiceDoc("A context longer than a row", ("a reply", "b"), 1))


def _bytes(s):
    return list(s.encode())


def test_encode_pair_splits_as_lm_eval():
    tok = ByteTokenizer()
    assert encode_pair(tok, "2 + 2 =", " 4") == ([BYTE_BOS, *_bytes("2 + 2 =")], _bytes(" 4"))
    # trailing spaces of the context go to the continuation (lm-eval's _encode_pair)
    assert encode_pair(tok, "2 + 2 =  ", " 4") == ([BYTE_BOS, *_bytes("2 + 2 =")], _bytes("   4"))


def test_requests_truncate_from_the_left_like_lm_eval():
    task = EvalTask("t", "t.jsonl", DOCS)
    reqs = build_requests([task], ByteTokenizer(), SEQ_LEN, vocab_size=259)
    assert [(r.doc, r.choice, r.n_scored) for r in reqs] == [(0, 0, 5), (0, 1, 6), (0, 2, 15), (1, 0, 3),
                                                             (1, 1, 6), (2, 0, 8), (2, 1, 2)]
    whole = [BYTE_BOS, *_bytes("A context longer than a row a reply")]  # 36 tokens
    assert reqs[5].tokens.tolist() == whole[-(SEQ_LEN + 1):]  # (context + continuation)[-(max_length + 1):]
    assert reqs[3].tokens.tolist() == [BYTE_BOS, *_bytes("2 + 2 =  4")]  # the context's space, then the delimiter
    with pytest.raises(DataError, match=r"t.jsonl: document 1, choice 0: token id 256 is outside the model's "
                                        r"vocabulary \[0, 200\)"):
        build_requests([task], ByteTokenizer(), SEQ_LEN, vocab_size=200)


def test_rows_are_packed_and_dealt_evenly_to_ranks():
    rows = pack_rows([20, 12, 30, 5, 7, 2], 32)
    assert rows == [[2, 5], [0, 1], [4, 3]]  # best fit, longest first
    task = EvalTask("t", "t.jsonl", DOCS * 3)
    reqs = build_requests([task], ByteTokenizer(), SEQ_LEN, vocab_size=259)
    seen = []
    shards = [deal_batches(reqs, SEQ_LEN, 2, rank, 3) for rank in range(3)]
    assert len({len(s) for s in shards}) == 1  # the same number of forwards on every rank
    for shard in shards:
        for rows in shard:
            b = make_batch(reqs, rows, SEQ_LEN)
            assert b["input_ids"].shape == (1, 2 * SEQ_LEN)
            cu = b["cu_seqlens"][0].tolist()
            assert {0, SEQ_LEN, 2 * SEQ_LEN} <= set(cu) and cu == sorted(cu)  # a boundary at every row start
            owner, labels = b["type_ids"].view(-1), b["labels"].view(-1)
            assert torch.equal(owner >= 0, labels != -100)
            seen += owner[owner >= 0].tolist()
    # every continuation token of every request scored exactly once, on one rank
    assert sorted(seen) == sorted(i for i, r in enumerate(reqs) for _ in range(r.n_scored))


def _tiny_model():
    cfg = build_config({"model": dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=259,
                                      multiple_of=16, dtype="fp32"), "data": {"seq_len": SEQ_LEN}})
    torch.manual_seed(0)
    return build_model(cfg).eval()


def test_packed_loglikelihoods_equal_each_request_alone():
    model = _tiny_model()
    task = EvalTask("t", "t.jsonl", DOCS)
    reqs = build_requests([task], ByteTokenizer(), SEQ_LEN, vocab_size=259)
    batches = deal_batches(reqs, SEQ_LEN, 2, 0, 1)

    def outputs(batch):  # the trainer's evaluation forward, one process: rows of seq_len
        mb = {k: batch[k][0].view(-1, SEQ_LEN) for k in ("input_ids", "labels", "position_ids", "type_ids")}
        yield model(mb["input_ids"], mb["position_ids"], batch["cu_seqlens"][0]), mb

    ev = TaskEvaluator([task], reqs, SEQ_LEN, batches, FlashGPTLMLoss("fused_chunked"), every=0, at_end=True)
    lls = ev.loglikelihoods(outputs, lambda: ())
    with torch.no_grad():
        for r, ll in zip(reqs, lls):  # by hand: the request alone, log-softmax, its continuation's log-probs
            ids = torch.tensor(r.tokens[:-1], dtype=torch.long).view(1, -1)
            logp = torch.log_softmax(model(ids).float()[0], dim=-1)
            targets = r.tokens[-r.n_scored:].tolist()
            rows = range(len(r.tokens) - 1 - r.n_scored, len(r.tokens) - 1)
            expected = sum(logp[i, t].item() for i, t in zip(rows, targets))
            assert ll == pytest.approx(expected, abs=1e-4), r
            assert ll < 0


def test_acc_and_acc_norm_as_lm_eval():
    docs = (ChoiceDoc("q", ("a", "bbbb"), 1), ChoiceDoc("q", ("x", "y"), 1), ChoiceDoc("q", ("yes", "no"), 1),
            ChoiceDoc("q", ("aa", "b"), 0))
    task = EvalTask("t", "t.jsonl", docs)
    # doc 0: acc picks "a" (-2 > -3: wrong), acc_norm "bbbb" (-3 / 4 > -2 / 1: right); doc 1: a tie goes to the
    # first choice (wrong for both); doc 2: acc picks "no" (right), acc_norm ties -6 / 3 = -4 / 2: the first (wrong);
    # doc 3: "aa" by both (right)
    m = choice_metrics(task, [[-2.0, -3.0], [-1.0, -1.0], [-6.0, -4.0], [-1.0, -5.0]])
    assert m == {"acc": 0.5, "acc_norm": 0.5, "loglik": (-3.0 - 1.0 - 4.0 - 1.0) / 4}
    per_doc = [choice_metrics(EvalTask("t", "t", (d,)), [ll]) for d, ll in
               zip(docs, [[-2.0, -3.0], [-1.0, -1.0], [-6.0, -4.0], [-1.0, -5.0]])]
    assert [(d["acc"], d["acc_norm"]) for d in per_doc] == [(0, 1), (0, 0), (1, 0), (1, 1)]


def test_task_file_errors_name_the_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"context": "c", "choices": ["a", "b"], "gold": 0}) + "\n\n"
                    + json.dumps({"context": "c", "choices": ["a", "b"], "gold": 2}) + "\n")
    with pytest.raises(DataError) as e:
        read_task("bad", str(path), "evaluation.tasks[0].path")
    assert str(e.value) == f"{path}:3: \"gold\": expected the index of the right choice (0..1), got 2"
    with pytest.raises(ConfigError, match=r"evaluation.tasks\[0\].path: no such task file"):
        read_task("bad", str(tmp_path / "missing.jsonl"), "evaluation.tasks[0].path")
    path.write_text('{"context": "c", "choices": ["only one"], "gold": 0}\n')
    with pytest.raises(DataError, match=r":1: \"choices\": expected a list of at least 2 non-empty strings"):
        read_task("bad", str(path), "k")


def test_config_section_is_checked():
    cfg = build_config({"evaluation": {"tasks": ["/data/tasks/hellaswag.jsonl"], "eval_every": 5}})
    assert cfg.evaluation.tasks == [{"name": "hellaswag", "path": "/data/tasks/hellaswag.jsonl"}]
    with pytest.raises(ConfigError) as e:
        build_config({"evaluation": {"tasks": [{"name": "a", "path": "x.jsonl"}, {"name": "a", "path": "y.jsonl"}]}})
    assert str(e.value) == ("config: evaluation.tasks[1].name: 'a' is taken by an earlier task; names must be "
                            "unique")
    with pytest.raises(ConfigError, match=r"evaluation.tasks\[0\]: expected dict\(name=str, path=str\)"):
        build_config({"evaluation": {"tasks": [{"file": "x.jsonl"}]}})
