"""The loss contract (internlm_core/loss_norm.py): the factors each rank applies make FSDP's mean over the data x
context ranks the gradient of L = mean over the global batch's micro-batches of each one's token mean, plus the
auxiliary losses' mean; checked by hand on dp 2 x cp 2 ranks with 2 micro-batches each (the pipeline's micro-batches:
the last stage runs all of them, its index carried by the target) with uneven token counts."""

from __future__ import annotations

import pytest
import torch

from internlm_core.loss_norm import LossNormalizer, context_share, grad_divisor
from internlm_core.parallel.pipeline import micro_batch_target, split_target

DP, CP, MICRO = 2, 2, 2
SCALE = 1024.0  # the gradient scaler's loss scale
# counted tokens (label != -100) of each micro-batch's two context chunks, by (data rank, micro-batch):
# uneven within and across micro-batches; (1, 1) has none at all
COUNTS = {(0, 0): (3, 1), (0, 1): (2, 2), (1, 0): (0, 5), (1, 1): (0, 0)}
CHUNK = 6  # tokens per chunk (the rest of each chunk is -100)


def _labels(n: int) -> torch.Tensor:
    return torch.tensor([7] * n + [-100] * (CHUNK - n))


def test_context_shares_are_the_chunks_counted_tokens_over_the_micro_batch():
    got = {}
    for key, counts in COUNTS.items():
        whole = torch.cat([_labels(n) for n in counts])
        got[key] = tuple(context_share(_labels(n), whole) for n in counts)
    assert got == {(0, 0): (0.75, 0.25), (0, 1): (0.5, 0.5), (1, 0): (0.0, 1.0), (1, 1): (0.0, 0.0)}


def test_the_factors_by_hand():
    norm = LossNormalizer(micro_num=MICRO, dp=DP, cp=CP)
    assert norm.grad_divisor == grad_divisor(DP, CP) == 4  # FSDP's mean over dp x cp ranks
    assert norm.weight(0.75) == 0.75 / 4  # M = dp * micro_num = 4 micro-batches in the global batch
    assert norm.backward_factor(SCALE) == SCALE * 2 / 2 == SCALE * norm.grad_divisor * norm.weight(1.0)
    assert norm.aux_factor(SCALE) == SCALE / 2
    assert LossNormalizer(micro_num=4).backward_factor(SCALE) == SCALE / 4  # one process: the plain mean


def _token_losses(w: torch.Tensor, rank: int, chunk: int, mb: int) -> torch.Tensor:
    """Per-token losses of one chunk, a smooth function of w that differs by token, rank, chunk and micro-batch."""
    x = torch.arange(CHUNK, dtype=torch.float64) + 10 * rank + 3 * chunk + 5 * mb
    return (w[0] * torch.sin(x) + w[1] * x / 10 - 1) ** 2


def _aux(w: torch.Tensor, rank: int, chunk: int, mb: int) -> torch.Tensor:
    """A family's auxiliary loss of one chunk (a mean over its tokens, as MoE's load-balance loss)."""
    return 0.01 * (1 + rank + chunk + mb) * (w ** 2).sum()


def _chunk_mean(w: torch.Tensor, rank: int, chunk: int, mb: int) -> torch.Tensor:
    n = COUNTS[(rank, mb)][chunk]
    return _token_losses(w, rank, chunk, mb)[:n].sum() / max(n, 1)


def test_fsdp_mean_of_the_ranks_backwards_is_the_gradient_of_the_global_loss():
    w0 = torch.tensor([0.3, -0.7], dtype=torch.float64)
    # the contract's L, written over micro-batches (not ranks): each micro-batch's token mean, averaged over the M
    # micro-batches, plus the aux losses averaged over the M * cp chunks
    w = w0.clone().requires_grad_()
    means = []
    for (rank, mb), counts in COUNTS.items():
        tokens = torch.cat([_token_losses(w, rank, c, mb)[:n] for c, n in enumerate(counts)])
        means.append(tokens.mean() if len(tokens) else tokens.sum())
    ce = torch.stack(means).mean()
    aux = torch.stack([_aux(w, r, c, mb) for (r, mb) in COUNTS for c in range(CP)]).mean()
    (ce + aux).backward()
    expected = w.grad.clone()
    assert abs(float(ce.detach()) - float(sum(means).detach()) / 4) < 1e-15  # 4 micro-batches; (1, 1) counts as 0

    # each rank (data r, context c) backpropagates its micro-batches' weighted chunk means and its aux losses with the
    # normalizer's factors; FSDP sums the gradients over the 4 ranks and divides by grad_divisor
    norm = LossNormalizer(micro_num=MICRO, dp=DP, cp=CP)
    summed, reported = torch.zeros(2, dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for rank in range(DP):
        for c in range(CP):
            w = w0.clone().requires_grad_()
            total = torch.zeros((), dtype=torch.float64)
            for mb in range(MICRO):
                whole = torch.cat([_labels(n) for n in COUNTS[(rank, mb)]])
                share = context_share(_labels(COUNTS[(rank, mb)][c]), whole)
                loss = norm.weighted(_chunk_mean(w, rank, c, mb), share)
                total += loss.detach()
                (loss * norm.backward_factor(SCALE) + _aux(w, rank, c, mb) * norm.aux_factor(SCALE)).backward()
            summed += w.grad
            reported += norm.rank_loss(total)  # the all-reduce over "pp_dp"
    torch.testing.assert_close(summed / norm.grad_divisor / SCALE, expected, rtol=1e-12, atol=0)
    assert float(norm.global_loss(reported)) == pytest.approx(float(ce.detach()), rel=1e-12)


def test_the_pipeline_target_carries_each_micro_batch_index():
    """The schedule splits the target along dim 0 as it splits the inputs; each piece names its micro-batch, in
    whatever order the schedule calls the loss (and for torch's metadata-inference call on micro-batch 0)."""
    micro, rows, seq = 4, 2, 5
    labels = torch.arange(micro * rows * seq).view(micro * rows, seq)
    type_ids = labels % 3
    target = micro_batch_target(labels, type_ids, micro)
    pieces = target.tensor_split(micro)  # torch.distributed.pipelining's TensorChunkSpec(0)
    for i in (0, 2, 1, 3, 0):
        got_labels, got_types, index = split_target(pieces[i])
        assert index.dim() == 0 and int(index) == i
        assert torch.equal(got_labels, labels[i * rows:(i + 1) * rows])
        assert torch.equal(got_types, type_ids[i * rows:(i + 1) * rows])
    shares = torch.tensor([0.75, 0.5, 0.0, 1.0])
    assert float(shares[split_target(pieces[3])[2]]) == 1.0
    with pytest.raises(ValueError, match="7 rows do not split into 4 micro-batches"):
        micro_batch_target(labels[:7], type_ids[:7], micro)


@pytest.mark.parametrize("field", ["micro_num", "dp", "cp"])
def test_a_non_positive_size_is_refused(field):
    with pytest.raises(ValueError, match=f"LossNormalizer.{field}: expected a positive int, got 0"):
        LossNormalizer(**{"micro_num": 1, field: 0})
