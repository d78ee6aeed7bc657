"""DeepSeek-V3's routing in model/moe: group-limited top-k over sigmoid scores with the selection bias,
routed_scaling_factor and summed shared experts equal transformers' DeepseekV3TopkRouter / DeepseekV3MoE (fp32,
offline, tiny shapes); the options' refusals; the blocked CPU attention with a value head dim other than q/k's."""

import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402

from internlm_core.errors import ConfigError  # noqa: E402
from internlm_core.model.attention import blocked_causal_attention  # noqa: E402
from internlm_core.model.moe import MoEArgs, MoEFeedForward, route  # noqa: E402
from internlm_core.model.moe.router import limit_to_groups  # noqa: E402

E, H, F_W = 16, 32, 24


def _hf_config(**kw):
    base = dict(hidden_size=H, moe_intermediate_size=F_W, n_routed_experts=E, num_experts_per_tok=4, n_group=4,
                topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=2)
    return transformers.DeepseekV3Config(**{**base, **kw})


def _args(**kw):
    base = dict(num_experts=E, top_k=4, ffn_width=F_W, moe_type="Dropless", score_func="sigmoid",
                norm_topk_prob=True, num_expert_groups=4, top_k_groups=2, routed_scaling_factor=2.5,
                expert_bias=True, aux_loss_coeff=0.0)
    return MoEArgs(**{**base, **kw})


def test_group_limited_routing_equals_transformers():
    torch.manual_seed(0)
    hf = hf_ds.DeepseekV3TopkRouter(_hf_config())
    with torch.no_grad():
        hf.weight.normal_(0, 0.5)
        hf.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(64, H)
    _, hf_w, hf_idx = hf(x)
    logits = F.linear(x, hf.weight)
    r = route(logits, _args(), training=False, bias=hf.e_score_correction_bias)
    ours = torch.zeros(64, E).scatter(1, r.experts, r.weights)
    theirs = torch.zeros(64, E).scatter(1, hf_idx, hf_w)
    assert torch.allclose(ours, theirs, atol=1e-6)
    # the groups limit something here: without them some tokens choose other experts
    free = route(logits, _args(num_expert_groups=1, top_k_groups=1), training=False,
                 bias=hf.e_score_correction_bias)
    assert not torch.equal(free.experts.sort(1).values, r.experts.sort(1).values)
    chosen_groups = (r.experts // (E // 4))
    assert all(len(set(row.tolist())) <= 2 for row in chosen_groups)


def test_limit_to_groups_by_hand():
    key = torch.tensor([[0.9, 0.8, 0.1, 0.0, 0.5, 0.45, 0.3, 0.95]])  # group sums of best 2: 1.7, 0.1, 0.95, 1.25
    out = limit_to_groups(key, groups=4, chosen=2)
    assert torch.equal(torch.isinf(out[0]), torch.tensor([False, False, True, True, True, True, False, False]))


def test_moe_layer_with_shared_experts_equals_transformers():
    torch.manual_seed(1)
    hf = hf_ds.DeepseekV3MoE(_hf_config()).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
        hf.gate.e_score_correction_bias.normal_(0, 0.1)
    layer = MoEFeedForward(H, _args(num_shared_experts=2, shared_expert_mix="sum")).eval()
    assert layer.coefficient is None and layer.gate.expert_bias is not None
    with torch.no_grad():
        layer.gate.weight.copy_(hf.gate.weight)
        layer.gate.expert_bias.copy_(hf.gate.e_score_correction_bias)
        gate, up = hf.experts.gate_up_proj.chunk(2, dim=1)
        layer.experts.w1.copy_(gate)
        layer.experts.w3.copy_(up)
        layer.experts.w2.copy_(hf.experts.down_proj)
        layer.shared_experts.w1.weight.copy_(hf.shared_experts.gate_proj.weight)
        layer.shared_experts.w3.weight.copy_(hf.shared_experts.up_proj.weight)
        layer.shared_experts.w2.weight.copy_(hf.shared_experts.down_proj.weight)
    x = torch.randn(2, 10, H)
    with torch.no_grad():
        assert (layer(x) - hf(x)).abs().max().item() < 1e-5


def test_routing_options_refused_in_one_line():
    cases = [(dict(num_expert_groups=3), "moe.num_expert_groups: expected an int >= 1 dividing num_experts=16"),
             (dict(top_k_groups=5), "moe.top_k_groups: expected an int in \\[1, num_expert_groups=4\\]"),
             (dict(top_k=12, top_k_groups=2), "moe.top_k_groups: expected groups holding at least top_k=12"),
             (dict(routed_scaling_factor=0.0), "moe.routed_scaling_factor: expected a number > 0"),
             (dict(noisy_gate_policy="RSample", expert_bias=False), "not 'RSample' with group-limited routing"),
             (dict(shared_expert_mix="mean"), "moe.shared_expert_mix: expected one of")]
    for kw, message in cases:
        with pytest.raises(ConfigError, match=message):
            _args(**kw)


def test_blocked_attention_value_head_dim_differs():
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 3, 40, 12), torch.randn(2, 3, 40, 12), torch.randn(2, 3, 40, 8)
    out = blocked_causal_attention(q, k, v, block=16)
    assert out.shape == (2, 3, 40, 8)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5)
