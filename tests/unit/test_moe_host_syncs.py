"""An MoE layer's host syncs on a CUDA run, counted on the CPU (tests/helpers/host_syncs.py): at most one per
micro-batch (forward and backward), the copy of the per-expert row counts the expert GEMMs split by (issue 34,
item 3: bincounts, a boolean mask, three `.tolist()`, `repeat_interleave` without its size, a pageable offsets
copy and the aux-loss scale's copy made ~15 per layer and micro-batch); the step-end statistics of every layer
reach the host with one copy. Expert parallel (one copy of the count matrix per layer) is counted by
tests/dist/test_moe_dispatch.py."""

from __future__ import annotations

import pytest
import torch

from internlm_core.model.internlm_moe.hooks import moe_step_metrics
from internlm_core.model.moe import MoEArgs, MoEFeedForward, grouped_mm_available, set_aux_loss_scale
from tests.helpers.host_syncs import HostSyncs

CASES = {
    "dropless": dict(moe_type="Dropless"),
    "capacity": dict(moe_type="GShard", capacity_factor=0.5, min_capacity=0, use_rts=False),
    "rts_top1": dict(moe_type="GShard", capacity_factor=0.75, min_capacity=0, use_rts=True),
    "grouped_shared_bias": dict(moe_type="Dropless", expert_gemm="grouped", num_shared_experts=1,
                                expert_bias_update_rate=1e-3, z_loss_coeff=1e-3, score_func="sigmoid"),
}


def layer(case: str) -> MoEFeedForward:
    torch.manual_seed(0)
    kw = dict(num_experts=4, top_k=1 if case == "rts_top1" else 2, ffn_width=16, aux_loss_coeff=0.01)
    args = MoEArgs(**kw, **CASES[case])
    return MoEFeedForward(32, args, init_std=0.2).train()


@pytest.mark.parametrize("case", list(CASES))
def test_an_moe_layer_syncs_once_per_micro_batch(case):
    if case.startswith("grouped") and not grouped_mm_available(torch.device("cpu"), torch.float32):
        pytest.skip("torch's grouped GEMM is missing on this CPU build")
    moe = layer(case)
    xs = [torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    set_aux_loss_scale(0.5)
    with HostSyncs(torch.device("cpu")) as syncs:
        for x in xs:
            moe(x.requires_grad_()).square().sum().backward()
    set_aux_loss_scale(1.0)
    assert syncs.total <= len(xs), (syncs.total, syncs.counts)
    assert moe.experts.w1.grad is not None and moe.gate.weight.grad is not None
    stats = moe._step_stats.pop()
    moe._step_stats.add(stats, moe.args.top_k)  # put back: what the step-end metrics read
    with HostSyncs(torch.device("cpu")) as syncs:
        metrics = moe_step_metrics(moe)
    assert syncs.events == [("d2h", "cpu")]  # the table of every layer, once
    load = stats.tokens_per_expert.double()
    assert metrics["moe/layer/max_load"] == float(load.max()) / float(load.mean())
    assert metrics["moe/layer/dropped"] == float(stats.dropped_fraction)
    assert metrics["moe/layer/aux_loss"] == float(stats.aux_loss) and metrics["moe/layer/z_loss"] == float(stats.z_loss)
