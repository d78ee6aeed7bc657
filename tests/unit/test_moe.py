"""The MoE layer (internlm_core/model/moe): gating on a hand-computed case, the dropless output and gradients against a
per-token reference, capacity drops, the aux-loss gradient through the output, the aux-loss-free expert bias, and
grouped against looped expert GEMMs."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from internlm_core.errors import ConfigError
from internlm_core.model.moe import (MoEArgs, MoEFeedForward, grouped_mm_available, route, set_aux_loss_scale,
                                     update_expert_bias)

# 4 tokens over 4 experts: softmax(log p + c) = p, logsumexp = c
P = torch.tensor([[0.50, 0.30, 0.10, 0.10],
                  [0.60, 0.10, 0.20, 0.10],
                  [0.45, 0.05, 0.15, 0.35],
                  [0.10, 0.20, 0.30, 0.40]], dtype=torch.float64)
SHIFT = torch.tensor([0.0, 1.0, 2.0, -1.0], dtype=torch.float64)
LOGITS = (P.log() + SHIFT[:, None]).float()


def hand_args(**kw) -> MoEArgs:
    base = dict(num_experts=4, top_k=2, ffn_width=8, capacity_factor=0.5, min_capacity=0, use_rts=False)
    return MoEArgs(**{**base, **kw})


def test_gating_hand_computed_top2_capacity():
    r = route(LOGITS, hand_args(), training=True)
    # first choices e0 e0 e0 e3, second choices e1 e2 e3 e2
    assert r.experts.tolist() == [[0, 1], [0, 2], [0, 3], [3, 2]]
    assert r.tokens_per_expert.tolist() == [3, 1, 2, 2]
    # capacity ceil(4 / 4 * 0.5 * 2) = 1; choice-major: e0 keeps t0; e3 keeps t3 (a first choice) over t2's second;
    # e2 keeps t1's second choice (the first in position order), not t3's
    assert r.capacity == 1
    assert r.keep.tolist() == [[True, True], [False, True], [False, False], [True, False]]
    # renormalized over the kept choices (InternEvo's top-2 / top-k gating)
    expected_w = torch.tensor([[0.5 / 0.8, 0.3 / 0.8], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    torch.testing.assert_close(r.weights, expected_w, atol=1e-6, rtol=0)
    # l_aux = E * sum_e mean_t(p_te) * (share of first choices on e) = 4 * (0.4125 * 3/4 + 0.2375 * 1/4)
    assert r.l_aux.item() == pytest.approx(4 * (1.65 / 4 * 0.75 + 0.95 / 4 * 0.25), abs=1e-6)
    assert r.l_aux.item() == pytest.approx(1.475, abs=1e-6)
    # z-loss: mean over tokens of logsumexp(logits)^2 = mean(0, 1, 4, 1)
    assert r.l_z.item() == pytest.approx(1.5, abs=1e-5)


def test_gating_hand_computed_variants():
    # without renormalization the kept pairs weigh their raw probabilities
    r = route(LOGITS, hand_args(norm_topk_prob=False), training=True)
    torch.testing.assert_close(r.weights, torch.tensor([[0.5, 0.3], [0.0, 0.2], [0.0, 0.0], [0.4, 0.0]]),
                               atol=1e-6, rtol=0)
    # min_capacity lifts the capacity to 2: only e0's third first choice (t2) goes
    r = route(LOGITS, hand_args(min_capacity=2), training=True)
    assert r.capacity == 2 and r.keep.tolist() == [[True, True], [True, True], [False, True], [True, True]]
    # eval uses eval_capacity_factor: ceil(4 / 4 * 2 * 2) = 4 keeps everything
    assert route(LOGITS, hand_args(eval_capacity_factor=2.0), training=False).keep.all()
    # drop_tokens=False and Dropless keep everything and renormalize over all k
    for args in (hand_args(drop_tokens=False), hand_args(moe_type="Dropless")):
        r = route(LOGITS, args, training=True)
        assert r.keep is None
        torch.testing.assert_close(r.weights[1], torch.tensor([0.6 / 0.8, 0.2 / 0.8]), atol=1e-6, rtol=0)
    # dropless l_aux counts every choice: 4 * sum_e P_e * count_e / 8
    r = route(LOGITS, hand_args(moe_type="Dropless"), training=True)
    assert r.l_aux.item() == pytest.approx(4 * (0.4125 * 3 + 0.1625 * 1 + 0.1875 * 2 + 0.2375 * 2) / 8, abs=1e-6)
    # top-1, capacity 1: e0 keeps t0 only; weights are the raw probabilities without renormalization
    r = route(LOGITS, hand_args(top_k=1, capacity_factor=1.0, norm_topk_prob=False), training=True)
    assert r.experts[:, 0].tolist() == [0, 0, 0, 3] and r.keep[:, 0].tolist() == [True, False, False, True]
    torch.testing.assert_close(r.weights[:, 0], torch.tensor([0.5, 0.0, 0.0, 0.4]), atol=1e-6, rtol=0)


def test_random_token_selection_is_seeded():
    logits = torch.zeros(64, 4)
    logits[:, 2] = 5.0  # every token prefers expert 2; capacity ceil(64 / 4) = 16
    args = hand_args(top_k=1, capacity_factor=1.0, use_rts=True)
    kept = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        kept.append(route(logits, args, training=True).keep[:, 0].nonzero().flatten().tolist())
    assert len(kept[0]) == 16 and kept[0] == kept[1]
    assert kept[0] != kept[2]
    assert kept[0] != list(range(16))  # not the first 16 (those are what use_rts=False keeps)
    assert route(logits, dataclasses.replace(args, use_rts=False), True).keep[:, 0].nonzero().flatten().tolist() \
        == list(range(16))


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ w1.t()) * (x @ w3.t())) @ w2.t()


def naive_moe(x: torch.Tensor, params: dict[str, torch.Tensor], args: MoEArgs) -> torch.Tensor:
    """Per token: sum over its top-k experts of w_k * expert_k(x) (softmax, renormalized top-k weights)."""
    outs = []
    for t in range(x.shape[0]):
        p = torch.softmax(x[t] @ params["gate.weight"].t(), dim=-1)
        w, idx = torch.topk(p, args.top_k)
        w = w / w.sum()
        out = sum(w[j] * swiglu(x[t], *(params[f"experts.{n}"][idx[j]] for n in ("w1", "w3", "w2")))
                  for j in range(args.top_k))
        if args.num_shared_experts:
            c = torch.softmax(x[t] @ params["coefficient.weight"].t() + params["coefficient.bias"], dim=-1)
            dense = swiglu(x[t], *(params[f"shared_experts.{n}.weight"] for n in ("w1", "w3", "w2")))
            out = out * c[0] + dense * c[1]
        outs.append(out)
    return torch.stack(outs)


@pytest.mark.parametrize("shared", [0, 1])
def test_dropless_matches_per_token_reference_with_gradients(shared):
    torch.manual_seed(0)
    args = MoEArgs(num_experts=4, top_k=2, ffn_width=12, moe_type="Dropless", aux_loss_coeff=0.0,
                   num_shared_experts=shared)
    layer = MoEFeedForward(10, args, init_std=0.3)
    params = {n: p.detach().clone().requires_grad_() for n, p in layer.named_parameters()}
    x = torch.randn(3, 7, 10)
    g = torch.randn(3, 7, 10)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = layer(x1)
    ref = naive_moe(x2.reshape(-1, 10), params, args).reshape(3, 7, 10)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    # fp32 summation order only: gradients of magnitude ~4 differ by ~1e-6 absolute, 3e-7 relative
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-6, rtol=1e-6)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, params[name].grad, atol=1e-6, rtol=1e-6, msg=name)
    assert layer.last_stats.dropped_fraction.item() == 0.0
    assert layer.last_stats.tokens_per_expert.sum().item() == 21 * 2


def one_hot_router_layer(**kw) -> MoEFeedForward:
    """A layer whose router sends a token e_i-ish input to expert i (gate.weight = 8 * identity)."""
    torch.manual_seed(1)
    args = MoEArgs(**{**dict(num_experts=4, top_k=1, ffn_width=8, capacity_factor=1.0, min_capacity=0,
                             use_rts=False, norm_topk_prob=False, aux_loss_coeff=0.0), **kw})
    layer = MoEFeedForward(4, args, init_std=0.5)
    with torch.no_grad():
        layer.gate.weight.copy_(8 * torch.eye(4))
    return layer


def test_capacity_drops_exactly_the_over_capacity_tokens():
    layer = one_hot_router_layer()
    x = torch.eye(4)[[0, 0, 1, 0, 0, 2]] + 0.01 * torch.randn(6, 4)  # four tokens for expert 0, capacity 2
    out = layer(x)
    w1, w3, w2 = (p.detach() for p in (layer.experts.w1, layer.experts.w3, layer.experts.w2))
    p = torch.softmax(x @ layer.gate.weight.detach().t(), dim=-1)
    for t, e in ((0, 0), (1, 0), (2, 1), (5, 2)):
        torch.testing.assert_close(out[t], p[t, e] * swiglu(x[t], w1[e], w3[e], w2[e]), atol=1e-6, rtol=0)
    assert torch.equal(out[3], torch.zeros(4)) and torch.equal(out[4], torch.zeros(4))  # the 3rd and 4th for e0
    assert layer.last_stats.capacity == 2
    assert layer.last_stats.dropped_fraction.item() == pytest.approx(2 / 6)
    assert layer.last_stats.tokens_per_expert.tolist() == [4, 1, 1, 0]  # counted before dropping
    # random token selection: two of the four expert-0 tokens, the same two for the same seed
    rts = one_hot_router_layer(use_rts=True)
    zero_rows = []
    for seed in (3, 3):
        torch.manual_seed(seed)
        out = rts(x)
        zero_rows.append([t for t in range(6) if torch.equal(out[t], torch.zeros(4))])
    assert zero_rows[0] == zero_rows[1] and len(zero_rows[0]) == 2 and set(zero_rows[0]) <= {0, 1, 3, 4}


@pytest.mark.parametrize("moe_type", ["GShard", "Dropless"])
def test_aux_loss_gradient_reaches_the_router_with_the_set_scale(moe_type):
    torch.manual_seed(0)
    args = MoEArgs(num_experts=4, top_k=2, ffn_width=8, moe_type=moe_type, use_rts=False, aux_loss_coeff=0.1,
                   z_loss_coeff=0.01)
    layer = MoEFeedForward(8, args, init_std=0.3)
    plain = copy.deepcopy(layer)
    plain.args = dataclasses.replace(args, aux_loss_coeff=0.0, z_loss_coeff=0.0)
    x, g = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    scale = 0.25
    try:
        set_aux_loss_scale(scale)
        x1 = x.clone().requires_grad_()
        (scale * (layer(x1) * g).sum()).backward()
    finally:
        set_aux_loss_scale(1.0)
    # the reference: autograd of scale * (loss + 0.1 l_aux + 0.01 l_z), l_aux and l_z computed explicitly
    x2 = x.clone().requires_grad_()
    loss = (plain(x2) * g).sum()
    r = route(x2.reshape(-1, 8) @ plain.gate.weight.t(), args, training=True)
    (scale * (loss + 0.1 * r.l_aux + 0.01 * r.l_z)).backward()
    torch.testing.assert_close(layer.gate.weight.grad, plain.gate.weight.grad, atol=1e-6, rtol=0)
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-6, rtol=0)
    # and the aux terms do move the router's gradient
    x3 = x.clone().requires_grad_()
    plain.zero_grad()
    (scale * (plain(x3) * g).sum()).backward()
    assert (plain.gate.weight.grad - layer.gate.weight.grad).abs().max() > 1e-4


def test_expert_bias_changes_selection_not_weights_and_balances():
    layer = one_hot_router_layer(expert_bias_update_rate=0.05, moe_type="Dropless")
    assert layer.gate.expert_bias.tolist() == [0.0] * 4 and "gate.expert_bias" in layer.state_dict()
    x = torch.eye(4)[torch.arange(8) % 4] + 0.01 * torch.randn(8, 4)
    with torch.no_grad():
        layer.gate.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 2.0]))  # every token now selects expert 3
    w = layer.gate.weight.detach().clone().requires_grad_()
    out = layer(x)
    assert layer.last_stats.tokens_per_expert.tolist() == [0, 0, 0, 8]
    # the weight is the unbiased softmax score of expert 3 (norm_topk_prob=False): same output and router gradient
    p3 = torch.softmax(x @ w.t(), dim=-1)[:, 3:]
    ref = p3 * swiglu(x, *(p.detach()[3] for p in (layer.experts.w1, layer.experts.w3, layer.experts.w2)))
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(layer.gate.weight.grad, w.grad, atol=1e-6, rtol=0)
    update_expert_bias(layer)  # loads [0, 0, 0, 8]: mean 2 -> +rate for 0..2, -rate for 3
    torch.testing.assert_close(layer.gate.expert_bias, torch.tensor([0.05, 0.05, 0.05, 1.95]))
    assert layer.take_load() is None  # consumed


def test_update_expert_bias_moves_toward_balance():
    torch.manual_seed(0)
    layer = MoEFeedForward(16, MoEArgs(num_experts=4, top_k=1, ffn_width=8, moe_type="Dropless",
                                       expert_bias_update_rate=0.02), init_std=0.02)
    with torch.no_grad():
        layer.gate.weight[0] += 0.3  # expert 0 favoured by tokens with positive mean feature

    def imbalance() -> float:
        loads = layer.last_stats.tokens_per_expert.float()
        return (loads.max() / loads.mean()).item()

    x = torch.randn(256, 16) + 0.5
    with torch.no_grad():
        layer(x)
        before = imbalance()
        for _ in range(60):
            layer(x)
            update_expert_bias(layer)
        layer(x)
    assert before > 3.0 and imbalance() < before / 2, (before, imbalance())  # max/mean load: 3.8 -> 1.5


@pytest.mark.skipif(not grouped_mm_available(torch.device("cpu"), torch.float32),
                    reason="this torch has no grouped GEMM for fp32 on the CPU (torch._grouped_mm)")
def test_grouped_gemm_matches_loop():
    torch.manual_seed(0)
    args = MoEArgs(num_experts=4, top_k=2, ffn_width=32, moe_type="Dropless")
    loop = MoEFeedForward(16, args, init_std=0.2)
    grouped = copy.deepcopy(loop)
    grouped.experts.gemm = "grouped"
    x, g = torch.randn(40, 16), torch.randn(40, 16)
    x[:, 0] += 3.0  # uneven loads, an expert may get none
    outs = []
    for layer in (loop, grouped):
        xi = x.clone().requires_grad_()
        out = layer(xi)
        (out * g).sum().backward()
        outs.append((out, xi.grad))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-5, rtol=1e-5)
    for (name, a), b in zip(loop.named_parameters(), grouped.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5, msg=name)
    # shapes the kernel cannot take (rows not 16-byte aligned) fall back to the loop
    odd = MoEFeedForward(6, dataclasses.replace(args, expert_gemm="grouped", ffn_width=5))
    assert odd(torch.randn(4, 6)).shape == (4, 6)


def test_expert_parallel_split_is_checked_and_slices_the_local_experts():
    layer = MoEFeedForward(8, MoEArgs(num_experts=4, top_k=2, ffn_width=8))
    full = layer.experts.w2.detach().clone()
    with pytest.raises(ConfigError, match=r"4 experts cannot be split over 3 expert-parallel ranks"):
        layer.set_expert_parallel(None, 3, 0)
    layer.set_expert_parallel(None, 2, 1)
    assert layer.num_local_experts == 2 and torch.equal(layer.experts.w2.detach(), full[2:])
    with pytest.raises(ConfigError, match="moe.top_k: expected an int in"):
        MoEArgs(num_experts=4, top_k=5, ffn_width=8)
    assert math.isclose(MoEArgs(num_experts=4, ffn_width=8, noisy_gate_policy="None").capacity(10, True), 5)


def test_activation_checkpointing_recomputes_the_same_drops_and_counts_once():
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    args = MoEArgs(num_experts=4, top_k=1, ffn_width=8, capacity_factor=0.5, min_capacity=0, use_rts=True,
                   noisy_gate_policy="Jitter", expert_bias_update_rate=0.01)
    plain = MoEFeedForward(16, args, init_std=0.3)
    ckpt = copy.deepcopy(plain)
    x, g = torch.randn(40, 16), torch.randn(40, 16)
    grads = []
    for layer, call in ((plain, lambda m, t: m(t)), (ckpt, lambda m, t: checkpoint(m, t, use_reentrant=False))):
        torch.manual_seed(5)  # the recompute replays the jitter and the random token selection (RNG restored)
        xi = x.clone().requires_grad_()
        (call(layer, xi) * g).sum().backward()
        grads.append([xi.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    assert plain.last_stats.dropped_fraction.item() == 0.5
    assert torch.equal(plain.take_load(), ckpt.take_load())  # the recompute did not count its tokens again
    step = ckpt.pop_step_stats()
    assert step.num_tokens == 40 and step.tokens_per_expert.sum().item() == 40 and ckpt.pop_step_stats() is None


def test_noisy_gate_policies_act_in_training_only():
    torch.manual_seed(0)
    logits = torch.randn(64, 4)
    clean = torch.topk(logits, 2).indices
    rs = hand_args(noisy_gate_policy="RSample", moe_type="Dropless")
    torch.manual_seed(1)
    noisy = route(logits, rs, training=True).experts
    assert torch.equal(noisy[:, 0], clean[:, 0])  # the first choice stays the clean one for k >= 2
    assert not torch.equal(noisy[:, 1], clean[:, 1])  # the second is Gumbel-sampled
    assert torch.equal(route(logits, rs, training=False).experts, clean)
    top1 = route(logits, dataclasses.replace(rs, top_k=1), training=True).experts[:, 0]
    assert not torch.equal(top1, clean[:, 0])  # k == 1: the one choice is sampled
    layer = MoEFeedForward(8, hand_args(noisy_gate_policy="Jitter"))
    x = torch.randn(5, 8)
    assert torch.equal(layer.gate.eval()(x), x @ layer.gate.weight.detach().t())
    torch.manual_seed(2)
    a = layer.gate.train()(x)
    torch.manual_seed(2)
    assert torch.equal(a, layer.gate(x)) and not torch.allclose(a, x @ layer.gate.weight.detach().t(), atol=1e-7)
    assert torch.allclose(a, x @ layer.gate.weight.detach().t(), rtol=0.05, atol=0.05)  # within the 1% jitter
