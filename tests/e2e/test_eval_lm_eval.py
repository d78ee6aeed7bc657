"""Evaluation during training against lm-evaluation-harness: a tiny run scores a local multiple-choice task at
evaluation.eval_every; tools/evaluate.py exports its checkpoint and runs lm-eval (HF backend, offline) on the same
task file: acc, acc_norm and every choice's log-likelihood agree to 1e-4. Two FSDP ranks (the same global batch,
rows of the task dealt to both) score as one process."""

import json

import pytest

from tests.helpers.launch import read_metrics, run_script, run_train

pytestmark = pytest.mark.slow
pytest.importorskip("lm_eval")

DOCS = [
    {"context": "The capital of France is", "choices": ["Paris", "Rome", "a big city"], "gold": 0},
    {"context": "2 + 2 =", "choices": ["4", "five"], "gold": 0},
    {"context": "def f(x):\n    return ", "choices": ["x", "None", "x + 1"], "gold": 2},
    # 89 bytes and BOS: longer than seq_len 64, left-truncated as lm-eval truncates
    {"context": "Water boils at sea level, where the air pressure is one atmosphere, at a temperature of",
     "choices": ["100 degrees", "0 degrees"], "gold": 0},
    {"context": "import numpy as", "choices": ["np", "pd"], "gold": 0},
    {"context": "The sky is", "choices": ["blue", "green", "made of cheese"], "gold": 0},
]
COMMON = ["data.total_steps=2", "data.seq_len=64", "model.vocab_size=259", "tokenizer=byte", "data.valid_every=0",
          "evaluation.eval_every=2", "evaluation.batch_size=2"]


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("task") / "tiny_mc.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    return path


def _train(run, task_file, nproc, extra):
    args = ["--config", "configs/tiny.py", "--run-dir", str(run), "--set", *COMMON,
            f"evaluation.tasks=[{{'name': 'tiny_mc', 'path': '{task_file}'}}]", *extra]
    p = run_train(args, nproc=nproc)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    evals = read_metrics(run, "eval")
    assert [r["step"] for r in evals] == [2]  # eval_every=2, and not again at the end of step 2
    (details,) = [json.loads(line) for line in (run / "eval_details.jsonl").read_text().splitlines()]
    assert details["step"] == 2 and details["task"] == "tiny_mc"
    assert {k: evals[0][f"eval/tiny_mc/{k}"] for k in ("acc", "acc_norm", "loglik")} == \
        {k: details[k] for k in ("acc", "acc_norm", "loglik")}
    return details


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, task_file):
    """One process, micro_num 4: the global batch of two data-parallel ranks of micro_num 2."""
    run = tmp_path_factory.mktemp("one") / "run"
    details = _train(run, task_file, 1, ["data.micro_num=4", "parallel.zero1=1", "ckpt.enable_save_ckpt=True",
                                         f"ckpt.save_ckpt_folder={run / 'ckpt'}"])
    return run, details


def test_in_loop_scores_equal_lm_eval(one_process, task_file, tmp_path):
    run, ours = one_process
    out = tmp_path / "results.json"
    env = {"HF_HOME": str(tmp_path / "hf_home"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    p = run_script("tools/evaluate.py", ["--checkpoint", str(run / "ckpt"), "--tasks", f"tiny_mc={task_file}",
                                         "--out", str(out), "--batch-size", "4"], extra_env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "tiny_mc: acc=" in p.stdout
    theirs = json.loads(out.read_text())["tasks"]["tiny_mc"]
    assert theirs["num_docs"] == len(DOCS)
    assert theirs["acc"] == ours["acc"] and theirs["acc_norm"] == ours["acc_norm"]
    assert theirs["loglik"] == pytest.approx(ours["loglik"], abs=1e-4)
    assert [len(x) for x in theirs["loglikelihoods"]] == [len(d["choices"]) for d in DOCS]
    for doc, a, b in zip(DOCS, ours["loglikelihoods"], theirs["loglikelihoods"]):
        assert a == pytest.approx(b, abs=1e-4), doc
    # a model after 2 steps still guesses: the log-likelihoods are far from 0 and differ between choices
    flat = [x for lls in ours["loglikelihoods"] for x in lls]
    assert max(flat) < -5 and len({round(x, 3) for x in flat}) == len(flat)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(run / "tensorboard"))
    tb.Reload()
    assert [(e.step, round(e.value, 6)) for e in tb.Scalars("eval/tiny_mc/acc_norm")] == \
        [(2, round(ours["acc_norm"], 6))]


def test_two_fsdp_ranks_score_as_one_process(one_process, task_file, tmp_path):
    _, ours = one_process
    sharded = _train(tmp_path / "fsdp", task_file, 2, ["data.micro_num=2"])
    assert sharded["acc"] == ours["acc"] and sharded["acc_norm"] == ours["acc_norm"]
    for a, b in zip(sharded["loglikelihoods"], ours["loglikelihoods"]):
        assert a == pytest.approx(b, abs=1e-4)
