"""The CPU fast paths against their reference paths: fused chunked cross entropy vs torch's, blocked matmul
attention (causal, and with per-block document masks) vs SDPA (causal, and with the dense document mask), the
16-bit linear with fp32 GEMMs vs fp32 math rounded once."""

import pytest
import torch
import torch.nn.functional as F

import internlm_core.loss as loss_module
from internlm_core.loss import FlashGPTLMLoss, _ChunkedCrossEntropy
from internlm_core.model.layers import HalfLinearFp32Gemm, linear
from internlm_core.model.attention import (PackedMeta, _causal_document_mask, attention, block_document_masks,
                                           blocked_causal_attention, build_packed_meta,
                                           document_ids_from_cu_seqlens)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cross_entropy_equals_torch(dtype, compiled, monkeypatch):
    g = torch.Generator().manual_seed(0)
    n, v = 300, 1000
    monkeypatch.setattr(loss_module, "_CHUNK_BYTES", 4 * v * 128)  # chunks of 128 rows: 128, 128, 44
    x = (3 * torch.randn(n, v, generator=g)).to(dtype).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    y[::7] = -100
    fused = FlashGPTLMLoss("fused_chunked_compiled" if compiled else "fused_chunked")
    # the mean (the gradient computed in forward as is), a power-of-two and another factor, per-token weights
    w = torch.rand(n, generator=g)
    for outer in (lambda l, t: l, lambda l, t: 0.5 * l, lambda l, t: 3.0 * l, lambda l, t: (t * w).sum()):
        loss, side = fused(x, y)
        ref = F.cross_entropy(x.float(), y, ignore_index=-100)
        assert side.predictions is not None
        assert torch.allclose(loss, ref, atol=1e-5, rtol=1e-6)
        tokens, _ = _ChunkedCrossEntropy.apply(x, y, compiled)
        (gx,) = torch.autograd.grad(outer(loss, tokens), x)
        token = F.cross_entropy(x.float(), y, ignore_index=-100, reduction="none")
        (gr,) = torch.autograd.grad(outer(ref, token), x)
        assert gx.dtype == dtype
        # per element: fp32 within a few units of rounding of the softmax; bf16 one rounding of each element (two
        # when scaled by a factor that is not a power of two); tests/unit/test_loss_numerics.py checks every path
        tol = 4e-6 if dtype == torch.float32 else 2**-7
        assert ((gx.float() - gr.float()).abs() <= tol * gr.abs() + 1e-30).all()
    assert torch.equal(side.predictions, x.detach().argmax(-1))
    token = F.cross_entropy(x.detach().float(), y, ignore_index=-100, reduction="none")
    assert torch.allclose(side.token_losses, token, atol=1e-5)
    assert torch.all(side.token_losses[::7] == 0)


def test_reference_cross_entropy_when_asked_or_smoothing():
    x, y = torch.randn(4, 9), torch.randint(0, 9, (4,))
    for loss_fn in (FlashGPTLMLoss("torch"), FlashGPTLMLoss(use_flash=False), FlashGPTLMLoss(label_smoothing=0.1)):
        assert loss_fn.kernel == "torch"
        _, side = loss_fn(x, y)
        assert side.predictions is None
        assert (side.token_losses is None) == (loss_fn.label_smoothing > 0)  # smoothed losses are not the NLL
    with pytest.raises(ValueError, match="'fused_chunked' has no label smoothing"):
        FlashGPTLMLoss("fused_chunked", label_smoothing=0.1)


@pytest.mark.parametrize("kv_heads,block", [(4, 256), (2, 256), (4, 32), (2, 48)])
def test_blocked_document_attention_equals_dense_document_mask(kv_heads, block):
    g = torch.Generator().manual_seed(1)
    B, T, H, D = 3, 128, 4, 16
    cu = torch.tensor([0, 5, 70, 128, 129, 200, 256, 300, 384], dtype=torch.int32)  # a 1-token document too
    seg = document_ids_from_cu_seqlens(cu, B, T)
    meta = build_packed_meta(cu, B, T, "cpu_blocked", torch.device("cpu"))
    assert meta.block_masks is not None and meta.mask is None
    dense = PackedMeta(None, meta.max_seqlen, _causal_document_mask(seg))
    q = torch.randn(B, T, H, D, generator=g, requires_grad=True)
    k = torch.randn(B, T, kv_heads, D, generator=g, requires_grad=True)
    v = torch.randn(B, T, kv_heads, D, generator=g, requires_grad=True)
    w = torch.randn(B, T, H, D, generator=g)
    if block == 256:  # the trainer's path
        a = attention(q, k, v, meta, "cpu_blocked")
    else:  # several query blocks, also one not dividing T
        a = blocked_causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block,
                                     masks=block_document_masks(seg, block)).transpose(1, 2)
    b = attention(q, k, v, dense, "sdpa")
    assert (a - b).abs().max().item() < 1e-5
    ga = torch.autograd.grad((a * w).sum(), (q, k, v))
    gb = torch.autograd.grad((b * w).sum(), (q, k, v))
    for x, y in zip(ga, gb):
        assert (x - y).abs().max().item() < 1e-4


@pytest.mark.parametrize("kv_heads,T,block", [(4, 128, 32), (2, 100, 32), (4, 64, 256)])
def test_blocked_causal_attention_equals_sdpa(kv_heads, T, block):
    g = torch.Generator().manual_seed(2)
    N, H, D = 2, 4, 16
    q = torch.randn(N, H, T, D, generator=g, requires_grad=True)
    k = torch.randn(N, kv_heads, T, D, generator=g, requires_grad=True)
    v = torch.randn(N, kv_heads, T, D, generator=g, requires_grad=True)
    w = torch.randn(N, H, T, D, generator=g)
    a = blocked_causal_attention(q, k, v, block)
    b = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != H)
    assert (a - b).abs().max().item() < 1e-5
    for x, y in zip(torch.autograd.grad((a * w).sum(), (q, k, v)), torch.autograd.grad((b * w).sum(), (q, k, v))):
        assert (x - y).abs().max().item() < 1e-4


@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_equals_f_linear(bias):
    from internlm_core.model.layers import Linear
    g = torch.Generator().manual_seed(3)
    lin = Linear(24, 40, bias=bias)
    x = torch.randn(3, 7, 24, generator=g, requires_grad=True)
    w = torch.randn(3, 7, 40, generator=g)
    y = lin(x)
    ref = F.linear(x, lin.weight, lin.bias)
    assert torch.allclose(y, ref, atol=1e-5)
    params = [x, lin.weight] + ([lin.bias] if bias else [])
    for a, b in zip(torch.autograd.grad((y * w).sum(), params), torch.autograd.grad((ref * w).sum(), params)):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: F.linear in bf16
        assert lin(x).dtype == torch.bfloat16


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_linear_with_fp32_gemm(dtype, autocast):
    """Output and both gradients within one rounding of the fp32 math (the error bound of any 16-bit GEMM that
    accumulates in fp32: half an ulp of each operand and of the result, scaled by sum |a||b|), under 16-bit
    weights and under autocast; the 16-bit operands are what autograd keeps."""
    g = torch.Generator().manual_seed(1)
    x32, w32, b32 = torch.randn(3, 40, 96, generator=g), torch.randn(80, 96, generator=g), torch.randn(80, generator=g)
    dy = torch.randn(3, 40, 80, generator=g).to(dtype)
    x = x32.to(dtype).requires_grad_()
    w = (w32 if autocast else w32.to(dtype)).requires_grad_()
    b = (b32 if autocast else b32.to(dtype)).requires_grad_()
    with torch.autocast("cpu", dtype=dtype, enabled=autocast):
        y = HalfLinearFp32Gemm.apply(x, w.to(dtype)) + b.to(dtype) if not autocast else linear(x, w, b)
    assert y.dtype == dtype
    y.backward(dy)
    xr, wr, dyr = x.detach().double(), w.detach().to(dtype).double(), dy.double()
    ulp = 2.0 ** (-8 if dtype == torch.bfloat16 else -11)
    checks = [(y.double(), xr @ wr.t() + b.detach().to(dtype).double(), xr.abs() @ wr.abs().t()),
              (x.grad.double(), dyr @ wr, dyr.abs() @ wr.abs()),
              (w.grad.double(), dyr.reshape(-1, 80).t() @ xr.reshape(-1, 96),
               dyr.abs().reshape(-1, 80).t() @ xr.abs().reshape(-1, 96))]
    for got, ref, scale in checks:
        err = (got - ref).abs() / (scale + ref.abs() + 1e-30)
        assert err.max().item() <= 4 * ulp, err.max().item()
    assert w.grad.dtype == w.dtype and x.grad.dtype == dtype


def test_half_linear_backward_multiplies_in_fp32_inside_autocast():
    """A backward started inside autocast (torch's pipeline schedule runs forward and backward in one autocast
    context; on the CPU the autograd engine keeps the caller's autocast state) still runs fp32 GEMMs: autocast
    would cast them back to bf16, the emulated ~100x slower kernel on CPUs without native bf16."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class GemmDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
                self.seen.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
            return func(*args, **(kwargs or {}))

    x = torch.randn(2, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(12, 16, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = HalfLinearFp32Gemm.apply(x, w)
        with GemmDtypes() as mode:
            y.sum().backward()
    assert len(mode.seen) == 2 and all(d == torch.float32 for dtypes in mode.seen for d in dtypes), mode.seen
