"""Every cross-entropy path (fused eager, fused compiled, torch, vocabulary-parallel) against an fp32 reference, in
fp32, bf16 and fp16 logits, with loss scaling, ignored labels and label smoothing, element by element.

The measure (`assert_gradient_close`) fails when an entry the reference has vanishes: every reference entry the
dtype can hold (at least its smallest subnormal) must be nonzero, normal-range entries within a relative bound
of the dtype's rounding, subnormal ones within one subnormal step. An absolute tolerance would let most entries
of a fp16 gradient fall to 0 unnoticed (the fused loss once did exactly that, see the last tests)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from internlm_core.loss import FlashGPTLMLoss
from internlm_core.model.layers import linear

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# relative error allowed per element: fp32 a few roundings of the softmax; 16 bits at most two roundings
REL = {torch.float32: 4e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def assert_gradient_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype,
                          magnitude: torch.Tensor | None = None) -> None:
    """`got` (in `dtype`) against the fp32 reference `ref`, per element. `magnitude`: the size of the terms each
    entry is a sum of (default |ref|); where they cancel (label smoothing: softmax - e/V) rounding is relative to
    them, not to their difference, and such ill-conditioned entries may round to 0."""
    fi = torch.finfo(dtype)
    got, ref = got.float(), ref.float()
    mag = ref.abs() if magnitude is None else magnitude
    smallest = fi.tiny * fi.eps  # the smallest subnormal number of `dtype`
    holds = (ref.abs() >= smallest) & (ref.abs() > 2 * REL[dtype] * mag)
    vanished = int(((got == 0) & holds).sum())
    assert vanished == 0, f"{vanished} of {int(holds.sum())} entries vanished ({vanished / int(holds.sum()):.1%})"
    err = (got - ref).abs()
    worst = (err / mag.clamp(min=fi.tiny)).max().item()
    assert (err <= REL[dtype] * 1.01 * mag + smallest).all(), f"largest error {worst:.3g} of the magnitude"


def reference(x: torch.Tensor, y: torch.Tensor, smoothing: float, scale: float):
    """fp32 loss and logits gradient of mean(CE) * scale from the same logits values."""
    xr = x.detach().float().requires_grad_()
    loss = F.cross_entropy(xr, y, ignore_index=-100, label_smoothing=smoothing)
    (loss * scale).backward()
    return loss.detach(), xr.grad


def logits_and_labels(n=257, v=3000, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(n, v, generator=g)).to(dtype)
    y = torch.randint(0, v, (n,), generator=g)
    y[::5] = -100
    return x, y


@pytest.fixture(scope="module")
def one_rank_mesh():
    """A 1-rank gloo group and mesh: vocabulary-parallel logits as DTensors, sharded along V over one rank."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if created:
        dist.destroy_process_group()


def run_loss(kernel, x, y, smoothing, scale, mesh=None):
    """(loss, logits gradient in x's dtype, side) of FlashGPTLMLoss(kernel) on x as the trainer drives it."""
    xx = x.clone().requires_grad_()
    fn = FlashGPTLMLoss(kernel, label_smoothing=smoothing)
    if kernel == "vocab_parallel":
        with loss_parallel():
            logits = DTensor.from_local(xx, mesh, [Shard(1)], run_check=False)
            loss, side = fn(logits, y)
            (loss * scale).backward()
    else:
        loss, side = fn(xx, y)
        (loss * scale).backward()
    return loss.detach(), xx.grad, side


CASES = [(kernel, smoothing) for kernel in ("fused_chunked", "fused_chunked_compiled", "torch", "vocab_parallel")
         for smoothing in (0.0, 0.1) if not (kernel.startswith("fused") and smoothing)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel,smoothing", CASES)
def test_every_loss_path_against_fp32_reference(kernel, smoothing, dtype, one_rank_mesh):
    x, y = logits_and_labels(dtype=dtype)
    # scale: the mean itself, fp16's 2**16 loss scale over 4 micro-batches, a factor that is not a power of two
    for scale in (1.0, 2.0**16 / 4, 3.0):
        loss, grad, side = run_loss(kernel, x, y, smoothing, scale, one_rank_mesh)
        ref_loss, ref_grad = reference(x, y, smoothing, scale)
        assert torch.allclose(loss.float(), ref_loss, rtol=2e-6, atol=0)
        assert grad.dtype == dtype
        valid = (y != -100).float().unsqueeze(1)
        terms = torch.softmax(x.float(), -1) + smoothing / x.shape[1]  # what (softmax - one_hot - e/V) adds up
        assert_gradient_close(grad, ref_grad, dtype, ref_grad.abs() + scale * terms * valid / valid.sum())
        assert torch.all(grad.float()[y == -100] == 0)
    token = F.cross_entropy(x.float(), y, ignore_index=-100, reduction="none")
    if smoothing:
        assert side.token_losses is None  # the smoothed per-token loss is not what perplexity is made of
    else:
        assert torch.allclose(side.token_losses, token, rtol=2e-6, atol=1e-6)
    if kernel.startswith("fused"):
        assert torch.equal(side.predictions, x.float().argmax(-1))


@pytest.mark.parametrize("kernel", ["fused_chunked", "torch", "vocab_parallel"])
def test_no_valid_label_gives_zero_loss_and_gradient(kernel, one_rank_mesh):
    x, _ = logits_and_labels(n=8, v=50, dtype=torch.float16)
    loss, grad, _ = run_loss(kernel, x, torch.full((8,), -100), 0.0, 2.0**16, one_rank_mesh)
    assert loss.item() == 0.0 and torch.all(grad == 0)


def test_the_measure_catches_vanishing_entries():
    """The fused loss's former fp16 gradient, (softmax - one_hot) / count rounded to fp16 before the loss scale:
    the measure must reject it, and an absolute tolerance would have let it pass."""
    x, y = logits_and_labels(n=2048, v=8000, dtype=torch.float16)
    scale = 2.0**16
    _, ref = reference(x, y, 0.0, scale)
    valid = (y != -100).float()
    p = torch.softmax(x.float(), -1)
    p[torch.arange(len(y)), y.clamp(min=0)] -= 1
    old = ((p * (valid / valid.sum()).unsqueeze(1)).half().float() * scale).half()
    with pytest.raises(AssertionError, match="entries vanished"):
        assert_gradient_close(old, ref, torch.float16)
    # the former test's tolerance (one 16-bit rounding of the largest entry, for every entry) accepted it
    assert (old.float() - ref).abs().max() <= 2**-7 * ref.abs().max()


@pytest.mark.parametrize("kernel", ["fused_chunked"])
@pytest.mark.parametrize("dtype,weight_tolerance", [(torch.float16, 0.005), (torch.bfloat16, 0.02)], ids=str)
def test_fused_loss_under_autocast_keeps_every_entry(kernel, dtype, weight_tolerance):
    """The issue's setting at a CPU-friendly size: a 16-bit autocast output layer, a 2**16 loss scale over 4
    micro-batches; every logit-gradient entry of the fp32 reference is kept, and the output weight's gradient is
    within 0.5% (fp16) / 2% (bf16) of a model run entirely in fp32. (The compiled kernel computes the same chunks;
    test_every_loss_path_against_fp32_reference holds it to the same per-entry measure in fp16 and bf16 with loss
    scaling, at a size that compiles in seconds.)"""
    N, V, H, scale = 2048, 16000, 64, 2.0**16 / 4
    g = torch.Generator().manual_seed(1)
    h = torch.randn(N, H, generator=g)
    W = (0.15 * torch.randn(V, H, generator=g)).requires_grad_()
    y = torch.randint(0, V, (N,), generator=g)
    y[::50] = -100
    (F.cross_entropy(h @ W.t(), y, ignore_index=-100) * scale).backward()
    w_ref, W.grad = W.grad, None
    with torch.autocast("cpu", dtype=dtype):
        logits = linear(h, W)  # the model's output layer (a 16-bit GEMM; fp32 products on CPUs without one)
    assert logits.dtype == dtype
    logits.retain_grad()
    loss, _ = FlashGPTLMLoss(kernel)(logits, y)
    (loss * scale).backward()
    _, ref = reference(logits, y, 0.0, scale)
    assert_gradient_close(logits.grad, ref, dtype)
    assert ((W.grad - w_ref).norm() / w_ref.norm()).item() < weight_tolerance
