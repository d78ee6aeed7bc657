"""CUDA autocast's norm rule emulated on the CPU (tests/helpers/cuda_autocast.py) through every attention backend and
the families with q/k norms, forward under bf16 autocast, backward outside it (as the trainer and CUDA run it).

Under CUDA autocast `rms_norm` returns fp32, so Qwen3's q/k norms handed fp32 q/k on next to a bf16 v, and the
context-parallel kernels' hand-written backward multiplied them (issue 33 item 2). The package's dtype policy
(numerics/precision.py): norms return their input's dtype, and attention takes q, k, v in one dtype
(model/context/blockwise.one_dtype). The multi-rank layouts (ring, all_to_all, 2d, pipeline) are in
tests/dist/test_cuda_autocast_layouts.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import internlm_core.model.internlm.model as internlm_model
from internlm_core.config import load_config
from internlm_core.model import build_model
from internlm_core.model.attention import attention, build_packed_meta
from internlm_core.model.context import ContextGroup, set_context_parallel
from internlm_core.model.layers import RMSNorm
from tests.helpers.cuda_autocast import cuda_norm_rules

BF16 = torch.bfloat16


def bf16_autocast():
    return torch.autocast("cpu", dtype=BF16)


def test_the_mode_gives_cuda_s_norm_dtypes_and_goes_away_after():
    x = torch.randn(2, 8, dtype=BF16)
    w = torch.ones(8, dtype=BF16)
    norms = {"F.rms_norm": lambda: F.rms_norm(x, (8,), w), "F.layer_norm": lambda: F.layer_norm(x, (8,), w),
             "nn.RMSNorm": lambda: nn.RMSNorm(8)(x), "nn.LayerNorm": lambda: nn.LayerNorm(8)(x)}
    with bf16_autocast():
        assert {k: f().dtype for k, f in norms.items()} == dict.fromkeys(norms, BF16)  # the CPU's own rule
    with cuda_norm_rules():
        with bf16_autocast():
            assert {k: f().dtype for k, f in norms.items()} == dict.fromkeys(norms, torch.float32)  # CUDA's
            # the package's norm follows the policy under either rule: its input's dtype
            assert RMSNorm(8, 1e-6)(x).dtype == BF16 and RMSNorm(8, 1e-6, fp32=True)(x).dtype == BF16
        assert F.rms_norm(x, (8,), w).dtype == BF16  # outside autocast: nothing changes
        torch.testing.assert_close(F.rms_norm(x.float(), (8,), w.float()), F.rms_norm(x, (8,), w).float(),
                                   atol=1e-2, rtol=1e-2)
    with bf16_autocast():
        assert F.rms_norm(x, (8,), w).dtype == BF16  # removed on exit


def _qkv(T: int = 64, H: int = 4, hkv: int = 2, D: int = 16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, T, H, D, generator=g).requires_grad_()
    k = torch.randn(2, T, hkv, D, generator=g).requires_grad_()
    v = torch.randn(2, T, hkv, D, generator=g).to(BF16).requires_grad_()
    return q, k, v


BACKENDS = ["cpu_blocked", "sdpa", "context ring", "context all_to_all"]


def _meta(backend: str, T: int):
    doc = torch.arange(2 * T).view(2, T) // 24  # packed documents
    if backend.startswith("context"):
        ctx = ContextGroup(None, 1, 0, backend.split()[1])
        return build_packed_meta(None, 2, T, "cpu_blocked", torch.device("cpu"), doc, context=ctx), "cpu_blocked"
    return build_packed_meta(None, 2, T, backend, torch.device("cpu"), doc), backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_q_k_next_to_bf16_v_through_every_backend(backend):
    """What CUDA autocast's q/k norms handed on (fp32 q/k, bf16 v): forward under autocast, backward outside it.
    Each gradient in its input's dtype, near the fp32 computation."""
    q, k, v = _qkv()
    meta, kernel = _meta(backend, 64)
    with bf16_autocast():
        out = attention(q, k, v, meta, kernel)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out.float() * dout).sum().backward()  # the backward outside autocast: dO V^T with V bf16
    assert out.dtype == BF16
    assert (q.grad.dtype, k.grad.dtype, v.grad.dtype) == (torch.float32, torch.float32, BF16)
    ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
    (attention(*ref, *_meta(backend, 64)) * dout).sum().backward()
    for name, got, want in zip("qkv", (q.grad, k.grad, v.grad), ref):
        err = ((got.float() - want.grad).abs().max() / want.grad.abs().max()).item()
        assert err < 0.05, f"{backend}: d{name} off by {err:.3f} of its largest entry"


def _model(model_type: str, backend: str):
    extra = ["model.num_experts=4", "moe.top_k=2"] if "MoE" in model_type else []
    cfg = load_config("configs/tiny.py", [f"model_type={model_type}", "data.seq_len=64", "model.num_layers=2",
                                          "model.hidden_size=64", "model.num_attention_heads=4",
                                          "model.num_kv_attention_heads=2", "model.head_dim=32", *extra])
    torch.manual_seed(0)
    model = build_model(cfg, attn_backend="cpu_blocked" if backend.startswith("context") else backend)
    if backend.startswith("context"):
        set_context_parallel(model, ContextGroup(None, 1, 0, backend.split()[1]))
    return model.to(BF16), cfg.model.vocab_size  # bf16 parameters: what FSDP's policy gathers


def _run(model, vocab: int, record: list):
    ids = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(2))
    doc = torch.arange(2 * 64).view(2, 64) // 24
    with bf16_autocast():
        logits = model(ids, document_ids=doc)
    logits.float().square().mean().backward()  # outside autocast, as the trainer runs it
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


@pytest.mark.parametrize("model_type", ["QWEN3", "QWEN3_MoE"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_q_k_norm_families_under_cuda_rules_forward_and_backward(model_type, backend, monkeypatch):
    """bf16 parameters (FSDP's policy) under bf16 autocast with CUDA's norm rule: every norm returns its input's
    dtype, q/k/v reach attention in one dtype, and the logits and gradients equal those of the CPU's own rule
    exactly (the rule no longer changes anything the model computes)."""
    model, vocab = _model(model_type, backend)
    seen: list[tuple] = []
    norms: list[tuple] = []
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.register_forward_hook(lambda mod, inp, out: norms.append((inp[0].dtype, out.dtype)))
    real = internlm_model.attention
    monkeypatch.setattr(internlm_model, "attention",
                        lambda q, k, v, *a: seen.append((q.dtype, k.dtype, v.dtype)) or real(q, k, v, *a))
    plain = _run(model, vocab, seen)
    with cuda_norm_rules():
        ruled = _run(model, vocab, seen)
    assert norms and all(i == o for i, o in norms), norms
    assert seen and all(len(set(d)) == 1 for d in seen), seen
    assert torch.equal(ruled[0], plain[0])
    assert ruled[1].keys() == plain[1].keys() and any("q_norm" in n for n in plain[1])
    for name, g in plain[1].items():
        assert torch.isfinite(g).all() and torch.equal(ruled[1][name], g), name


def test_one_caster_fsdp_policy_or_autocast_never_both():
    """numerics/precision.py's policy: a 16-bit run under FSDP computes without autocast (FSDP's policy casts);
    without FSDP autocast casts; fp32 never casts. parallel/dtype_policy.py decides when FSDP wraps the model."""
    from internlm_core.distributed import ParallelDims
    from internlm_core.numerics import resolve_precision
    from internlm_core.parallel.dtype_policy import fp32_modules, fsdp_wraps
    bf16 = resolve_precision("torch.bfloat16", "cuda")
    sharded = bf16.under_fsdp(True)
    assert bf16.uses_autocast and not bf16.fsdp_casts
    assert sharded.fsdp_casts and not sharded.uses_autocast and sharded.compute_dtype == BF16
    assert "FSDP gathers 16-bit parameters, no autocast" in sharded.describe()
    assert "(autocast)" in bf16.describe() and bf16.under_fsdp(False) == bf16
    fp32 = resolve_precision("torch.float32", "cpu")
    assert fp32.under_fsdp(True) == fp32 and not fp32.under_fsdp(True).uses_autocast
    with resolve_precision("torch.bfloat16", "cpu").under_fsdp(True).autocast():
        assert not torch.is_autocast_enabled("cpu")
    assert [fsdp_wraps(ParallelDims(world_size=w, **kw)) for w, kw in
            ((1, {}), (2, {}), (2, {"tp": 2}), (2, {"pp": 2}))] == [False, True, False, False]
    moe, _ = _model("QWEN3_MoE", "sdpa")
    gates = fp32_modules(list(moe.layers.values()))
    assert len(gates) == 2 and all(type(g).__name__ == "Router" and g.fsdp_param_dtype == torch.float32
                                   for g in gates)
    assert fp32_modules(list(_model("QWEN3", "sdpa")[0].layers.values())) == []
