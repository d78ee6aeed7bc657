"""Context parallel divides the activation memory of a long sequence (issue 26): one 8192-token sequence on four
context ranks peaks, per rank, at no more than 0.4x the activation memory one process needs for it (the CPU memory
report: peak resident memory less the interpreter, parameters, gradients and optimizer state)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import run_train

pytestmark = pytest.mark.slow

# one layer of a narrow model: the sequence-dependent memory (attention layout, activations, logits) dominates
ARGS = ["data.seq_len=8192", "data.micro_bsz=1", "data.micro_num=1", "data.total_steps=1", "data.valid_every=0",
        "data.fixed_random_dataset_seqlen=True", "model.num_layers=1", "model.hidden_size=64",
        "model.num_attention_heads=2", "model.vocab_size=256", "model.multiple_of=32", "monitor.memory_report=True",
        "monitor.log_every=100", "ckpt.enable_save_ckpt=False"]


def _activations(run_dir, ranks: int) -> list[int]:
    names = ["memory_report.json"] + [f"memory_report_rank{r}.json" for r in range(1, ranks)]
    return [json.loads((run_dir / n).read_text())["peak"]["activations_estimate"] for n in names]


def test_cp4_rank_holds_at_most_0_4_of_cp1_activations(tmp_path):
    measured = {}
    for cp in (1, 4):
        p = run_train(["--config", "configs/tiny.py", "--run-dir", str(tmp_path / f"cp{cp}"), "--set", *ARGS,
                       f"parallel.context={cp}"], nproc=cp, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        measured[cp] = _activations(tmp_path / f"cp{cp}", cp)
    one = measured[1][0]
    assert one > 200 * 2**20, measured  # the 8K sequence's activations dominate the measurement's noise
    worst = max(measured[4])
    assert worst <= 0.4 * one, (f"CP 4 rank peak activations {worst / 2**20:.1f} MiB > 0.4 x CP 1's "
                                f"{one / 2**20:.1f} MiB", measured)
