"""Grouped-query attention over packed documents (a mask) on SDPA: what backward keeps, measured on CPU.

CUDA's fused SDPA kernels take either fewer k/v heads (flash, no mask) or a mask (memory-efficient, equal
heads), so `enable_gqa` with a mask runs the math kernel, which keeps the fp32 probabilities [B, H, T, T].
`sdpa_attention` repeats k/v there; on CPU, whose flash kernel takes both, it passes them as they are."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from internlm_core.model.attention import _causal_document_mask, document_ids_from_cu_seqlens, sdpa_attention

B, T, H, HKV, D = 1, 1024, 8, 2, 32


def saved_bytes(fn) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct storages autograd saves for backward in fn(), and its output."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, T, D, generator=g, requires_grad=True) for h in (H, HKV, HKV))
    cu = torch.tensor([0, 300, 301, 700, T], dtype=torch.int32)
    return q, k, v, _causal_document_mask(document_ids_from_cu_seqlens(cu, B, T))


def test_gqa_with_a_document_mask_keeps_no_probability_matrix(inputs):
    q, k, v, mask = inputs
    probs = B * H * T * T * 4  # what the math kernel keeps: 32 MiB here, 2 GiB per layer for 7B at s=2048
    with sdpa_kernel(SDPBackend.MATH):  # the kernel CUDA falls to for enable_gqa with a mask
        math, ref = saved_bytes(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
    assert math >= probs
    for repeat, kv_heads in ((False, HKV), (True, H)):  # CPU's choice; CUDA's (k/v repeated), on CPU's fused kernel
        kept, out = saved_bytes(lambda: sdpa_attention(q, k, v, mask, repeat_kv=repeat))
        # q, k, v (repeated: H heads), output, log-sum-exp, and the mask as an additive fp32 [B, 1, T, T] (one per
        # call; tests/unit/test_estimate.py's "document mask" term): nothing per head is T x T
        assert kept == 4 * (B * H * T * D + 2 * B * kv_heads * T * D + B * H * T * D + B * H * T + B * T * T)
        assert kept < probs / 3
        assert (out - ref).abs().max().item() < 1e-5
        w = torch.randn_like(out)
        mine = torch.autograd.grad((out * w).sum(), (q, k, v))
        for a, b in zip(mine, torch.autograd.grad((ref * w).sum(), (q, k, v), retain_graph=True)):
            assert a.shape == b.shape and (a - b).abs().max().item() < 1e-4
