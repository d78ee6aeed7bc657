"""The loss contract (internlm_core/loss_norm.py): under both `loss.reduction`s the factors each rank applies make
FSDP's mean over the data x context ranks the gradient of L (token_mean: the global batch's per-token losses summed
over its counted tokens N; micro_batch_mean: the mean over the global batch's micro-batches of each one's token
mean), plus the auxiliary losses' mean; checked by hand on dp 2 x cp 2 ranks with 2 micro-batches each (the
pipeline's micro-batches: the last stage runs all of them, its index carried by the target) with uneven token
counts."""

from __future__ import annotations

import pytest
import torch

from internlm_core.config import load_config
from internlm_core.errors import ConfigError
from internlm_core.loss_norm import LossNormalizer, context_share, global_token_count, grad_divisor
from internlm_core.parallel.pipeline import micro_batch_target, split_target

DP, CP, MICRO = 2, 2, 2
SCALE = 1024.0  # the gradient scaler's loss scale
# counted tokens (label != -100) of each micro-batch's two context chunks, by (data rank, micro-batch):
# uneven within and across micro-batches and ranks; (1, 1) has none at all
COUNTS = {(0, 0): (3, 1), (0, 1): (2, 2), (1, 0): (0, 5), (1, 1): (0, 0)}
N = 13  # the global batch's counted tokens
CHUNK = 6  # tokens per chunk (the rest of each chunk is -100)


def _labels(n: int) -> torch.Tensor:
    return torch.tensor([7] * n + [-100] * (CHUNK - n))


class _Dims:
    """ParallelDims as the normalizer reads it, for one process."""

    dp, cp = 1, 2

    def group(self, name):  # noqa: D102
        raise AssertionError(f"one data-parallel rank sums over no group ({name})")


def test_context_shares_are_the_chunks_counted_tokens_over_the_micro_batch():
    got = {}
    for key, counts in COUNTS.items():
        whole = torch.cat([_labels(n) for n in counts])
        got[key] = tuple(context_share(_labels(n), whole) for n in counts)
    assert got == {(0, 0): (0.75, 0.25), (0, 1): (0.5, 0.5), (1, 0): (0.0, 1.0), (1, 1): (0.0, 0.0)}


def test_the_factors_by_hand():
    old = LossNormalizer(micro_num=MICRO, dp=DP, cp=CP, reduction="micro_batch_mean")
    assert old.grad_divisor == grad_divisor(DP, CP) == 4  # FSDP's mean over dp x cp ranks
    # InternLM's numbers, as before token_mean existed: S * cp / micro_num, then / micro_num and / dp
    assert old.backward_factor(SCALE) == SCALE * 2 / 2
    assert old.aux_factor(SCALE) == SCALE / 2
    assert torch.equal(old.rank_loss(torch.tensor(3.0)), torch.tensor(3.0) / MICRO)
    assert LossNormalizer(micro_num=4, reduction="micro_batch_mean").backward_factor(SCALE) == SCALE / 4
    new = LossNormalizer(micro_num=MICRO, dp=DP, cp=CP, tokens=torch.tensor(N))
    factor = new.backward_factor(SCALE)  # S * D / N, on the device: no host read
    assert factor.dtype == torch.float32 and factor.dim() == 0 and float(factor) == pytest.approx(SCALE * 4 / N)
    assert new.aux_factor(SCALE) == SCALE / 2  # the auxiliary losses keep their meaning
    assert float(new.rank_loss(torch.tensor(26.0))) == pytest.approx(26.0 * DP / N)
    # the chunk's term: its loss sum (mean * count, counted on the device) under token_mean, s * mean otherwise
    mean, labels = torch.tensor(2.5), _labels(4)
    assert float(new.part(mean, labels, 0.25)) == 10.0 and float(old.part(mean, labels, 0.25)) == 0.625
    assert old.part(mean, labels) is mean


def _token_losses(w: torch.Tensor, rank: int, chunk: int, mb: int) -> torch.Tensor:
    """Per-token losses of one chunk, a smooth function of w that differs by token, rank, chunk and micro-batch."""
    x = torch.arange(CHUNK, dtype=torch.float64) + 10 * rank + 3 * chunk + 5 * mb
    return (w[0] * torch.sin(x) + w[1] * x / 10 - 1) ** 2


def _aux(w: torch.Tensor, rank: int, chunk: int, mb: int) -> torch.Tensor:
    """A family's auxiliary loss of one chunk (a mean over its tokens, as MoE's load-balance loss)."""
    return 0.01 * (1 + rank + chunk + mb) * (w ** 2).sum()


def _chunk_mean(w: torch.Tensor, rank: int, chunk: int, mb: int) -> torch.Tensor:
    """What the loss function returns: the chunk's token mean (0 without counted tokens)."""
    n = COUNTS[(rank, mb)][chunk]
    return _token_losses(w, rank, chunk, mb)[:n].sum() / max(n, 1)


def _contract(w: torch.Tensor, reduction: str) -> torch.Tensor:
    """L written over the global batch (not the ranks), plus the aux losses averaged over its M * cp chunks."""
    tokens = {key: torch.cat([_token_losses(w, key[0], c, key[1])[:n] for c, n in enumerate(counts)])
              for key, counts in COUNTS.items()}
    if reduction == "token_mean":
        ce = torch.cat(list(tokens.values())).sum() / N
    else:  # each micro-batch's token mean, averaged over the M = 4 micro-batches; (1, 1) counts as 0
        ce = torch.stack([t.mean() if len(t) else t.sum() for t in tokens.values()]).mean()
    return ce + torch.stack([_aux(w, r, c, mb) for (r, mb) in COUNTS for c in range(CP)]).mean()


@pytest.mark.parametrize("reduction", ["token_mean", "micro_batch_mean"])
def test_fsdp_mean_of_the_ranks_backwards_is_the_gradient_of_the_global_loss(reduction):
    w0 = torch.tensor([0.3, -0.7], dtype=torch.float64)
    w = w0.clone().requires_grad_()
    _contract(w, reduction).backward()
    expected = w.grad.clone()
    ce = float(_contract(w0, reduction)) - float(torch.stack([_aux(w0, r, c, mb) for (r, mb) in COUNTS
                                                              for c in range(CP)]).mean())

    # each rank (data r, context c) backpropagates its micro-batches' chunk terms and its aux losses with the
    # normalizer's factors; FSDP sums the gradients over the 4 ranks and divides by grad_divisor; N is the sum of
    # the ranks' counts (the all-reduce)
    norm = LossNormalizer(MICRO, DP, CP, reduction, torch.tensor(N) if reduction == "token_mean" else None)
    summed, reported = torch.zeros(2, dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for rank in range(DP):
        for c in range(CP):
            w = w0.clone().requires_grad_()
            total = torch.zeros((), dtype=torch.float64)
            for mb in range(MICRO):
                chunk = _labels(COUNTS[(rank, mb)][c])
                share = context_share(chunk, torch.cat([_labels(n) for n in COUNTS[(rank, mb)]]))
                loss = norm.part(_chunk_mean(w, rank, c, mb), chunk, share)
                total += loss.detach()
                (loss * norm.backward_factor(SCALE) + _aux(w, rank, c, mb) * norm.aux_factor(SCALE)).backward()
            summed += w.grad
            reported += norm.rank_loss(total)  # the all-reduce over "pp_dp"
    # token_mean's factor is fp32 (S * D / N rounded once); micro_batch_mean's a Python float
    rtol = 1e-7 if reduction == "token_mean" else 1e-12
    torch.testing.assert_close(summed / norm.grad_divisor / SCALE, expected, rtol=rtol, atol=0)
    assert float(norm.global_loss(reported)) == pytest.approx(ce, rel=rtol)


def test_the_two_reductions_differ_on_uneven_micro_batches_and_agree_on_even_ones():
    w = torch.tensor([0.3, -0.7], dtype=torch.float64)
    assert abs(float(_contract(w, "token_mean")) - float(_contract(w, "micro_batch_mean"))) > 0.1
    one = LossNormalizer(2, tokens=torch.tensor(8))  # two micro-batches of 4 counted tokens each
    means, labels = [torch.tensor(1.5), torch.tensor(0.5)], _labels(4)
    token = sum(float(one.rank_loss(one.part(m, labels))) for m in means)
    micro = LossNormalizer(2, reduction="micro_batch_mean")
    assert token == sum(float(micro.rank_loss(micro.part(m, labels))) for m in means) == 1.0


def test_a_step_without_counted_tokens_backpropagates_zeros_not_nan():
    w = torch.tensor([0.3, -0.7], dtype=torch.float64, requires_grad=True)
    norm = LossNormalizer(1, tokens=global_token_count(_labels(0), torch.device("cpu"), None))
    assert int(norm.tokens) == 0 and norm.tokens.dim() == 0
    loss = norm.part(_token_losses(w, 0, 0, 0)[:0].sum() / 1, _labels(0))  # the loss function's mean: 0
    (loss * norm.backward_factor(SCALE)).backward()
    assert torch.equal(w.grad, torch.zeros(2, dtype=torch.float64)) and float(norm.rank_loss(loss.detach())) == 0.0


def test_of_step_counts_n_from_every_micro_batch_before_any_backward():
    labels = torch.stack([torch.cat([_labels(3), _labels(1)]), torch.cat([_labels(0), _labels(6)])])  # 2 rows
    norm = LossNormalizer.of_step("token_mean", 2, _Dims(), labels, torch.device("cpu"))
    assert (norm.micro_num, norm.dp, norm.cp, norm.reduction, int(norm.tokens)) == (2, 1, 2, "token_mean", 10)
    old = LossNormalizer.of_step("micro_batch_mean", 2, _Dims(), labels, torch.device("cpu"))
    assert old.tokens is None and old.backward_factor() == 1.0


def test_a_token_mean_step_reads_nothing_on_the_host():
    """N counted from the loader's (host) labels, copied to the device and used there: the factor and the reported
    loss stay device tensors (tests/helpers/host_syncs.py counts what a CUDA run would wait for)."""
    from internlm_core.utils.transfer import to_device
    from tests.helpers.host_syncs import HostSyncs
    device = torch.device("cpu")  # the run's device, as HostSyncs reads it
    labels = torch.stack([torch.cat([_labels(3), _labels(1)]), torch.cat([_labels(0), _labels(6)])])
    with HostSyncs(device) as syncs:
        syncs.host(labels)
        norm = LossNormalizer.of_step("token_mean", 2, _Dims(), labels, device)
        total = torch.zeros((), device=device)
        for row in labels:
            term = norm.part(torch.full((), 0.5, device=device), to_device(row, device))
            (term * norm.backward_factor(SCALE)).detach()
            total += term
        reported = norm.rank_loss(total)
    assert syncs.total == 0, syncs.sites
    assert float(reported) == pytest.approx(0.5)  # each token's loss 0.5: the token mean


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


def test_token_mean_without_n_and_an_unknown_reduction_are_refused():
    with pytest.raises(ValueError, match="reduction 'token_mean' needs tokens"):
        LossNormalizer(2).backward_factor()
    with pytest.raises(ValueError, match="LossNormalizer.reduction: expected one of token_mean, micro_batch_mean, "
                                         "got 'sum'"):
        LossNormalizer(2, reduction="sum")


def test_the_config_key():
    assert load_config("configs/tiny.py", []).loss.reduction == "token_mean"
    assert load_config("configs/tiny.py", ["loss.reduction=micro_batch_mean"]).loss.reduction == "micro_batch_mean"
    with pytest.raises(ConfigError, match="^configs/tiny.py: loss.reduction: expected token_mean or micro_batch_mean, "
                                          "got 'mean'$"):
        load_config("configs/tiny.py", ["loss.reduction=mean"])
