"""model/context/varlen.py: the varlen kernels' contract on the CPU (against a dense masked softmax by autograd),
and the varlen plumbing of every context-parallel mode (chunk pairing, log-sum-exp merge, backward with the final
output and log-sum-exp) equal to the blockwise core, rank by rank, with GQA, windows and packed documents; the
model on the contract path equals the plain model."""

from __future__ import annotations

import copy

import pytest
import torch

from internlm_core.model import ModelArgs, Transformer
from internlm_core.model.context import ContextGroup, set_context_parallel
from internlm_core.model.context.blockwise import attend_backward, attend_forward, from_groups, merge, plan_blocks
from internlm_core.model.context.blockwise import to_groups
from internlm_core.model.context.layout import _tokens
from internlm_core.model.context.varlen import (contract_backward, contract_forward, plan_calls, step_backward,
                                                step_forward)

TOL = dict(atol=1e-5, rtol=1e-5)


def _dense(q, k, v, cu_q, cu_k, causal, window, scale=None):
    """The contract by its definition: a [Tq, Tk] mask, a plain softmax, autograd for the gradients."""
    Tq, H, D = q.shape
    rep = H // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    allowed = torch.zeros(Tq, k.shape[0], dtype=torch.bool)
    left, right = window
    right = 0 if causal else right
    for i in range(len(cu_q) - 1):
        qa, qb, ka, kb = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        pos = torch.arange(qb - qa)[:, None] + (kb - ka) - (qb - qa)  # bottom-right alignment
        j = torch.arange(kb - ka)[None, :]
        ok = torch.ones(qb - qa, kb - ka, dtype=torch.bool)
        if right >= 0:
            ok &= j <= pos + right
        if left >= 0:
            ok &= j >= pos - left
        allowed[qa:qb, ka:kb] = ok
    s = torch.einsum("qhd,khd->hqk", q, kk) * (scale or D ** -0.5)
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)
    return out, lse


@pytest.mark.parametrize("causal,window,hkv", [(True, (-1, 0), 4), (True, (3, 0), 2), (False, (-1, -1), 1),
                                               (False, (2, -1), 2), (False, (0, -1), 4)])
def test_the_contract_is_the_kernels_definition(causal, window, hkv):
    """Segments of unequal query and key lengths (bottom-right alignment), GQA, windows: out, lse fp32 [H, Tq],
    and the gradients from any out and lse (here the call's own)."""
    g = torch.Generator().manual_seed(7)
    lq, lk = [3, 5, 1, 6], [7, 5, 4, 6]  # every query sees a key under each case
    cu_q = torch.tensor([0] + lq).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lk).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lq), 4, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(sum(lk), hkv, 8, generator=g, requires_grad=True) for _ in range(2))
    dout = torch.randn(sum(lq), 4, 8, generator=g)
    want, want_lse = _dense(q, k, v, cu_q, cu_k, causal, window, scale=0.3)
    grads = torch.autograd.grad((want * dout).sum(), (q, k, v))
    out, lse = contract_forward(q.detach(), k.detach(), v.detach(), cu_q, cu_k, max(lq), max(lk), 0.3, causal,
                                window)
    assert lse.shape == (4, sum(lq)) and lse.dtype == torch.float32
    torch.testing.assert_close(out, want.detach(), **TOL)
    torch.testing.assert_close(lse, want_lse.detach(), **TOL)
    got = contract_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, cu_q, cu_k, max(lq), max(lk), 0.3,
                            causal, window)
    for name, a, b in zip("qkv", got, grads):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"d{name}: {m}")


def _documents(B: int, T: int, seed: int, longest: int = 13) -> torch.Tensor:
    """Rows of many documents of 1 to longest-1 tokens (they straddle chunk borders), ids rising."""
    g = torch.Generator().manual_seed(seed)
    rows, nxt = [], 0
    for _ in range(B):
        ids = []
        while len(ids) < T:
            ids += [nxt] * int(torch.randint(1, longest, (1,), generator=g))
            nxt += 1
        rows.append(torch.tensor(ids[:T]))
    return torch.stack(rows)


def _views(mode: str, C: int, inner: int, rank: int, doc: torch.Tensor):
    """(query tokens, source tokens per step) of context rank `rank`, as build_context_meta makes them."""
    a = {"ring": 1, "all_to_all": C, "2d": inner}[mode]
    n, o = C // a, rank // a
    groups = [[g * a + j for j in range(a)] for g in range(n)]
    T = doc.shape[1]
    query = _tokens(groups[o], T, C, doc, doc)
    return query, [query] + [_tokens(groups[(o - s) % n], T, C, doc, doc) for s in range(1, n)]


def _blockwise(q5, kvs, query, sources, window, dout5):
    """The reference: blockwise steps merged by log-sum-exp, backward with the final out and lse."""
    out = lse = None
    plans = [plan_blocks(query, src, window, 4, 8) for src in sources]
    for (k4, v4), src, plan in zip(kvs, sources, plans):
        part = attend_forward(q5, k4, v4, query, src, plan)
        out, lse = part if out is None else merge(out, lse, *part)
    delta = (dout5 * out).sum(-1)
    dq = torch.zeros_like(q5)
    dkv = []
    for (k4, v4), src, plan in zip(kvs, sources, plans):
        dk, dv = torch.zeros_like(k4), torch.zeros_like(v4)
        attend_backward(q5, k4, v4, lse, dout5, delta, query, src, plan, dq, dk, dv)
        dkv.append((dk, dv))
    return out, dq, dkv


@pytest.mark.parametrize("mode,C,inner", [("all_to_all", 4, 4), ("ring", 4, 1), ("2d", 4, 2), ("ring", 2, 1)])
@pytest.mark.parametrize("window,hkv,longest", [(None, 4, 13), (None, 2, 40), (5, 2, 13), (11, 1, 60), (3, 4, 3)])
def test_the_varlen_plumbing_equals_the_blockwise_core_on_every_rank(mode, C, inner, window, hkv, longest):
    B, T, H, D = 2, 16 * C, 4, 8
    doc = _documents(B, T, seed=C + hkv, longest=longest)
    g = torch.Generator().manual_seed(3)
    for rank in range(C):
        query, sources = _views(mode, C, inner, rank, doc)
        Sq = len(query.index)
        q, dout = torch.randn(B, Sq, H, D, generator=g), torch.randn(B, Sq, H, D, generator=g)
        kvs = [(torch.randn(B, len(s.index), hkv, D, generator=g), torch.randn(B, len(s.index), hkv, D, generator=g))
               for s in sources]
        q5, do5 = to_groups(q, kvs[0][0], kvs[0][1])[0], to_groups(dout, kvs[0][0], kvs[0][1])[0]
        kv4 = [tuple(x.transpose(1, 2).contiguous() for x in kv) for kv in kvs]
        want_out, want_dq, want_dkv = _blockwise(q5, kv4, query, sources, window, do5)

        out = torch.zeros(H, B * Sq, D)
        lse = torch.full((H, B * Sq), float("-inf"))
        calls = [plan_calls(query, src, window, torch.device("cpu")) for src in sources]
        qf = q.reshape(B * Sq, H, D)
        assert len(calls) == len(sources) and all(len(c) <= 3 for c in calls)
        if mode == "all_to_all":  # the whole rows in natural order: one causal call
            assert len(calls[0]) == 1 and calls[0][0].causal
        for s, ((k, v), step) in enumerate(zip(kvs, calls)):
            step_forward("contract", qf, k.flatten(0, 1), v.flatten(0, 1), step, out, lse, first=s == 0)
        outf = out.transpose(0, 1).contiguous()
        tag = f"{mode} rank {rank}"
        torch.testing.assert_close(outf.view(B, Sq, H, D), from_groups(want_out), **TOL, msg=lambda m: f"{tag}: {m}")
        dq = torch.zeros(B * Sq, H, D)
        for (k, v), step, (wdk, wdv) in zip(kvs, calls, want_dkv):
            dk, dv = torch.zeros(k.flatten(0, 1).shape), torch.zeros(v.flatten(0, 1).shape)
            step_backward("contract", dout.reshape(B * Sq, H, D), qf, k.flatten(0, 1), v.flatten(0, 1), outf, lse,
                          step, dq, dk, dv)
            torch.testing.assert_close(dk.view(k.shape), wdk.transpose(1, 2), **TOL, msg=lambda m: f"{tag} dk: {m}")
            torch.testing.assert_close(dv.view(v.shape), wdv.transpose(1, 2), **TOL, msg=lambda m: f"{tag} dv: {m}")
        torch.testing.assert_close(dq.view(B, Sq, H, D), from_groups(want_dq), **TOL, msg=lambda m: f"{tag} dq: {m}")


@pytest.mark.parametrize("window", [None, 6])
def test_the_transformer_on_the_contract_path_is_the_plain_model(window):
    """A one-rank context group on the "varlen_contract" backend: the varlen autograd Function end to end."""
    args = ModelArgs(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_width=48,
                     max_seqlen=32, attn_backend="cpu_blocked", init_std=0.1, sliding_window=window)
    torch.manual_seed(0)
    plain = Transformer(args)
    cp = copy.deepcopy(plain)
    for m in cp.modules():
        if getattr(m, "backend", None) == "cpu_blocked":
            m.backend = "varlen_contract"
    cp.args.attn_backend = "varlen_contract"
    set_context_parallel(cp, ContextGroup(None, 1, 0, "ring"))
    ids = torch.randint(0, 64, (2, 32))
    doc = _documents(2, 32, seed=1)
    want = plain(ids, document_ids=doc)
    got = cp(ids, document_ids=doc)
    torch.testing.assert_close(got, want, **TOL)
    (want ** 2).sum().backward()
    (got ** 2).sum().backward()
    for (name, p), (_, w) in zip(cp.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p.grad, w.grad, atol=1e-5 * float(w.grad.abs().max()), rtol=1e-5,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("hkv,window", [(4, None), (2, 7), (1, None)])
def test_packed_rows_reach_varlen_attn_with_cu_seqlens_window_and_gqa(monkeypatch, hkv, window):
    """attn_backend torch_varlen without context parallel: torch's varlen_attn (CUDA only) stood in for by the
    contract; what it gets (the flash path's cu_seqlens, bf16, window (w - 1, 0), GQA asked for) and the result
    against the CPU path."""
    import torch.nn.attention.varlen as tv

    from internlm_core.model.attention import attention, build_packed_meta
    from internlm_core.utils import torch_compat
    seen = []

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False, **kw):
        seen.append((q.dtype, cu_q.dtype, tuple(window_size), enable_gqa, max_q))
        return contract_forward(q, k, v, cu_q, cu_k, max_q, max_k, None, False, window_size)[0]

    monkeypatch.setattr(tv, "varlen_attn", varlen_attn)
    torch_compat.varlen_attn_gqa.cache_clear()
    try:
        B, T, H, D = 2, 48, 4, 8
        doc = _documents(B, T, seed=4, longest=20)
        g = torch.Generator().manual_seed(0)
        q = torch.randn(B, T, H, D, generator=g)
        k, v = torch.randn(B, T, hkv, D, generator=g), torch.randn(B, T, hkv, D, generator=g)
        meta = build_packed_meta(None, B, T, "torch_varlen", torch.device("cpu"), document_ids=doc, window=window)
        assert meta.mask is None and meta.block_masks is None and meta.cu_seqlens.dtype == torch.int32
        got = attention(q, k, v, meta, "torch_varlen")
        ref_meta = build_packed_meta(None, B, T, "cpu_blocked", torch.device("cpu"), document_ids=doc, window=window)
        want = attention(q, k, v, ref_meta, "cpu_blocked")
    finally:
        torch_compat.varlen_attn_gqa.cache_clear()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=3e-2, rtol=0)  # the kernel computes in bf16
    longest = int((meta.cu_seqlens[1:] - meta.cu_seqlens[:-1]).max())
    assert seen == [(torch.bfloat16, torch.int32, (window - 1, 0) if window else (-1, 0), hkv != H, longest)]
