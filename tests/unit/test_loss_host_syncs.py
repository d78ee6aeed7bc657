"""What a CUDA run's micro-batch must not do, checked on the CPU: read a device value on the host (an `.item()`, an
`int()` of a tensor, a boolean mask's data-dependent shape), which makes the host wait for the GPU. At the ATen level
those are `_local_scalar_dense` and the ops whose output size depends on the values (nonzero, masked_select, ...):
the fused loss's forward and backward and the metric's update issue none of them (issue 27, item 7: the fp32
backward read the count and the incoming gradient on the host, 3-4 times per micro-batch). The GPU check runs the
same under torch.cuda.set_sync_debug_mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from internlm_core.loss import FlashGPTLMLoss
from internlm_core.metrics import AccPerplex, cross_entropy_and_argmax

HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique_consecutive", "_unique2", "is_nonzero",
              "item", "equal"}


class HostReads(TorchDispatchMode):
    """Records every ATen op that hands a tensor's value to the host."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def batch(dtype, n=96, v=300):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, v, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::7] = -100
    return logits, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scale", [1.0, 0.5, 3.0])  # the mean, micro_num 2, a factor that is not a power of two
def test_the_fused_loss_reads_nothing_on_the_host(dtype, scale):
    logits, labels = batch(dtype)
    with HostReads() as reads:
        loss, side = FlashGPTLMLoss("fused_chunked")(logits, labels)
        (loss * scale).backward()
        AccPerplex({0: "en"}).update(logits.detach(), labels, None, side.token_losses, side.predictions)
    assert reads.ops == []
    ref = logits.detach().float().requires_grad_()
    (F.cross_entropy(ref, labels, ignore_index=-100) * scale).backward()
    assert torch.allclose(logits.grad.float(), ref.grad, rtol=2e-2 if dtype != torch.float32 else 1e-5, atol=1e-7)


def test_the_fp32_mean_gradient_is_the_stored_one_rounded_once():
    """The mean's incoming gradient times the count is 1 up to the rounding of 1 / count (41 tokens: fp32(1/41) * 41
    rounds to 1 - 2**-24): snapped to 1 on the device, the gradient is exactly what the forward stored, and a
    power-of-two scale (micro_num 2) gives exactly half of it."""
    for scale in (1.0, 0.5):
        logits, labels = batch(torch.float32, n=48)
        assert int((labels != -100).sum()) == 41
        loss, _ = FlashGPTLMLoss("fused_chunked")(logits, labels)
        fused = loss.grad_fn.next_functions[0][0].next_functions[0][0]  # div <- sum <- the fused loss
        stored = fused.saved_tensors[0].clone()  # (softmax - one_hot) / count, rounded once
        (loss * scale).backward()
        assert torch.equal(logits.grad, stored * scale)


def test_the_metric_under_label_smoothing_holds_no_fp32_copy_of_the_logits():
    """Under label smoothing the loss returns no per-token cross entropy; the metric computes it a chunk at a time
    (equal to F.cross_entropy on fp32 logits), without a host read and without any [N, V] fp32 tensor."""
    logits, labels = batch(torch.bfloat16, n=2048, v=3000)
    x = logits.detach()

    class Largest(HostReads):
        def __init__(self):
            super().__init__()
            self.fp32 = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if isinstance(out, torch.Tensor) and out.dtype == torch.float32:
                self.fp32 = max(self.fp32, out.numel())
            return out
    with Largest() as seen:
        losses, argmax = cross_entropy_and_argmax(x, labels)
        AccPerplex({0: "en"}).update(x, labels)
    assert seen.ops == [] and seen.fp32 < x.numel() // 4
    ref = F.cross_entropy(x.float(), labels, ignore_index=-100, reduction="none")
    assert torch.equal(losses, ref) and torch.equal(argmax, x.float().argmax(-1))
