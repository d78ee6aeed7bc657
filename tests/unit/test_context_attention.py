"""model/context in one process: the zigzag layout, the blockwise attention core (forward and its hand-written
backward against autograd through the plain kernels, documents, GQA, any token order, a sliding window), what it
skips and keeps for backward, the byte formula, and the Transformer hook on a context group of one rank."""

from __future__ import annotations

import copy

import pytest
import torch

from internlm_core.model import ModelArgs, Transformer
from internlm_core.model.attention import block_document_masks, blocked_causal_attention
from internlm_core.model.context import (ContextGroup, blockwise_attention, plan_blocks, predicted_context_bytes,
                                         set_context_parallel, zigzag_indices)
from internlm_core.model.context.blockwise import token_set
from internlm_core.model.context.ulysses import heads_for_all_to_all

TOL = dict(atol=1e-5, rtol=1e-5)


def test_zigzag_indices_cover_the_row_once_and_balance_the_causal_work():
    T, C = 64, 4
    parts = [zigzag_indices(T, C, r) for r in range(C)]
    assert parts[1].tolist() == list(range(8, 16)) + list(range(48, 56))
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(T))
    work = {int((p + 1).sum()) for p in parts}  # keys a causal query sees: its index + 1
    assert work == {64 * 65 // 2 // 4}  # a quarter of the whole square's 2080 on every rank
    with pytest.raises(ValueError, match=r"seq_len 60 must be a multiple of 2 \* size = 8"):
        zigzag_indices(60, 4, 0)
    with pytest.raises(ValueError, match="expected 0 <= rank < size, got rank 4 of size 4"):
        zigzag_indices(64, 4, 4)


def test_context_group_rejects_bad_modes_and_sizes():
    with pytest.raises(ValueError, match="expected one of ring, all_to_all, 2d, got 'ulysses'"):
        ContextGroup(None, 2, 0, "ulysses")
    with pytest.raises(ValueError, match="inner: expected a divisor of size 4, got 3"):
        ContextGroup(None, 4, 0, "2d", inner=3)
    with pytest.raises(ValueError, match="only mode '2d' has an inner"):
        ContextGroup(None, 4, 0, "ring", inner=2)
    with pytest.raises(ValueError, match="expected 0 <= rank < size 2, got 3"):
        ContextGroup(None, 2, 3, "ring")


def _docs(B: int, T: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    rows, nxt = [], 0
    for _ in range(B):
        ids = []
        while len(ids) < T:
            ids += [nxt] * int(torch.randint(1, 40, (1,), generator=g))
            nxt += 1
        rows.append(torch.tensor(ids[:T]))
    return torch.stack(rows)


def _grads(out, inputs, dout):
    return (out.detach(), *torch.autograd.grad((out * dout).sum(), inputs))


@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_blockwise_core_equals_autograd_of_the_plain_kernel(hkv):
    """Documents, GQA, tokens in a shuffled order: output and dq/dk/dv to 1e-5 in fp32."""
    B, T, H, D = 2, 100, 4, 8
    g = torch.Generator().manual_seed(hkv)
    q = torch.randn(B, T, H, D, generator=g, requires_grad=True)
    k, v = (torch.randn(B, T, hkv, D, generator=g, requires_grad=True) for _ in range(2))
    dout = torch.randn(B, T, H, D, generator=g)
    doc = _docs(B, T)
    ref = blocked_causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                   masks=block_document_masks(doc)).transpose(1, 2)
    want = _grads(ref, (q, k, v), dout)
    # any order (runs of 10 tokens shuffled, as a rank's chunks are): the mask reads the token indices
    perm = torch.arange(T).view(10, 10)[torch.randperm(10, generator=g)].flatten()
    got = _grads(blockwise_attention(q[:, perm], k[:, perm], v[:, perm], perm, doc[:, perm], block=16),
                 (q, k, v), dout[:, perm])
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b[:, perm] if name == "out" else b, **TOL, msg=name)


def test_blockwise_core_with_a_sliding_window_equals_sdpa_under_the_same_mask():
    B, T, H, D, w = 1, 48, 2, 8, 5
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, T, H, D, generator=g, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, T, H, D, generator=g)
    doc = torch.tensor([[0] * 20 + [1] * 28])
    i = torch.arange(T)
    mask = (doc[0, :, None] == doc[0, None, :]) & (i[None] <= i[:, None]) & (i[None] > i[:, None] - w)
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           attn_mask=mask).transpose(1, 2)
    want = _grads(ref, (q, k, v), dout)
    got = _grads(blockwise_attention(q, k, v, i, doc, window=w, block=8), (q, k, v), dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, **TOL, msg=name)


def test_bf16_inputs_run_and_stay_near_the_fp32_result():
    B, T, H, D = 1, 64, 4, 16
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    doc = torch.zeros(B, T, dtype=torch.int64)
    ref = blockwise_attention(q, k, v, torch.arange(T), doc, block=16)
    qb, kb, vb = (x.bfloat16().requires_grad_() for x in (q, k, v))
    out = blockwise_attention(qb, kb, vb, torch.arange(T), doc, block=16)
    out.sum().backward()
    assert out.dtype == qb.grad.dtype == kb.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_the_plan_skips_future_blocks_and_other_documents():
    T = 64
    doc = torch.tensor([[0] * 32 + [1] * 32])
    t = token_set(torch.arange(T), doc)
    plan = plan_blocks(t, t, block=16)
    # (key start, key end, full): the diagonal blocks need the mask, the past of the same document does not
    assert plan.blocks == [(0, 16, [(0, 16, False)]), (16, 32, [(0, 16, True), (16, 32, False)]),
                           (32, 48, [(32, 48, False)]), (48, 64, [(32, 48, True), (48, 64, False)])]
    one = token_set(torch.arange(T), torch.zeros(1, T, dtype=torch.int64))
    assert plan_blocks(one, one, block=16, range_keys=32).blocks[-1] == (48, 64, [(0, 32, True), (32, 48, True),
                                                                                  (48, 64, False)])  # capped
    shuffled = token_set(torch.cat([torch.arange(48, 64), torch.arange(0, 16)]), torch.zeros(1, 32, dtype=torch.int64))
    assert plan_blocks(shuffled, shuffled, window=8, block=16).blocks == [(0, 16, [(0, 16, False)]),
                                                                          (16, 32, [(16, 32, False)])]


def test_backward_keeps_nothing_of_size_t_squared():
    B, T, H, D = 1, 1024, 1, 8
    q, k, v = (torch.randn(B, T, H, D, requires_grad=True) for _ in range(3))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = blockwise_attention(q, k, v, torch.arange(T), torch.zeros(B, T, dtype=torch.int64))
    assert max(saved) <= B * T * H * D, saved  # q, k, v, out (and their views) and lse; no [T, T] block
    out.sum().backward()


def test_predicted_bytes_by_hand_and_the_heads_rule():
    # all_to_all over 4, 8 heads, 2 k/v heads repeated to 4: 2 * (2*8 + 2*4) heads, 3 of 4 parts sent
    tokens = 64 // 4
    assert predicted_context_bytes("all_to_all", 4, 1, 2, 64, 8, 2, 16, 2, 3) == \
        3 * 2 * (2 * 8 + 2 * 4) // 4 * 3 * 2 * tokens * 16 * 2
    # ring over 4: 3 shifts of bf16 k, v forward and backward, 4 of the fp32 accumulators
    shift = 2 * 2 * 2 * tokens * 16
    assert predicted_context_bytes("ring", 4, 1, 2, 64, 8, 2, 16, 2, 1) == 2 * 3 * shift * 2 + 4 * shift * 4
    k = torch.zeros(1, 4, 2, 8)
    assert heads_for_all_to_all(k, k, 8, 4)[0].shape == (1, 4, 4, 8)
    with pytest.raises(ValueError, match="the 6 local attention heads must be a multiple of 4"):
        heads_for_all_to_all(k, k, 6, 4)


def test_the_transformer_under_a_one_rank_context_group_is_the_plain_model():
    """The hook without communication: set_context_parallel, document_ids instead of cu_seqlens, same logits."""
    args = ModelArgs(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_width=48,
                     max_seqlen=32, attn_backend="cpu_blocked", init_std=0.1)
    torch.manual_seed(0)
    plain = Transformer(args)
    cp = copy.deepcopy(plain)
    set_context_parallel(cp, ContextGroup(None, 1, 0, "ring"))
    assert cp.context is not None and plain.context is None
    assert copy.deepcopy(cp).context is cp.context  # the group is shared, not copied
    ids = torch.randint(0, 64, (2, 32))
    doc = _docs(2, 32)
    torch.testing.assert_close(cp(ids, document_ids=doc), plain(ids, document_ids=doc), **TOL)
    with pytest.raises(ValueError, match="give document_ids of the rank's chunk"):
        cp(ids, cu_seqlens=torch.tensor([0, 32, 64], dtype=torch.int32))
    with pytest.raises(ValueError, match="has no module with a `context` attribute"):
        set_context_parallel(torch.nn.Linear(2, 2), ContextGroup(None, 1, 0, "ring"))
