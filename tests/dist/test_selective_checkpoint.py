"""Selective activation checkpointing under expert parallel 2 (two gloo ranks; this file is also the driver each
rank runs): a MoE layer whose forward is recomputed selectively gives the gradients of no checkpointing, bitwise,
and its backward runs only the gradient's token all-to-alls (2: dispatch and combine), where whole-block
checkpointing repeats the forward's (3 more: the split counts and both token exchanges)."""

from __future__ import annotations

import copy

import pytest

from tests.helpers.launch import ROOT, env

pytestmark = pytest.mark.slow


def test_selective_checkpointing_does_not_repeat_the_expert_all_to_all():
    from tests.helpers import warm
    p = warm.run(str(ROOT / "tests/dist/test_selective_checkpoint.py"), [], env(), ROOT, timeout=120, nproc=2)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert p.stdout.count(": ok") == 2, p.stdout


def _backward_counting(layer, x, grad, seed: int):
    """Forward and backward of sum(layer(x) * grad); (x.grad, the all_to_all_single calls of the backward)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.c10d.alltoall_base_.default:
                Count.calls += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(seed)
    x = x.clone().requires_grad_()
    out = layer(x)
    with Count():
        (out * grad).sum().backward()
    return x.grad, Count.calls


def main() -> None:
    import torch
    import torch.distributed as dist

    from internlm_core.model.moe import MoEArgs, MoEFeedForward
    from internlm_core.parallel import checkpoint_and_compile

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = MoEFeedForward(16, MoEArgs(num_experts=4, top_k=2, ffn_width=8, moe_type="Dropless",
                                     aux_loss_coeff=0.01, z_loss_coeff=0.001), init_std=0.2)
    g = torch.Generator().manual_seed(100 + rank)
    x, grad = torch.randn(2 + rank, 5, 16, generator=g), torch.randn(2 + rank, 5, 16, generator=g)
    results = {}
    for setting in (False, True, "selective"):
        layer = copy.deepcopy(ref)
        layer.set_expert_parallel(None, 2, rank)
        checkpoint_and_compile([layer], setting, compile=False)
        x_grad, calls = _backward_counting(layer, x, grad, seed=1000 + rank)
        results[setting] = (x_grad, [p.grad for p in layer.parameters()], calls)
    none, full, selective = results[False], results[True], results["selective"]
    assert none[2] == 2 and full[2] == 5 and selective[2] == 2, (none[2], full[2], selective[2])
    assert torch.equal(selective[0], none[0]), "input gradient"
    assert all(torch.equal(a, b) for a, b in zip(selective[1], none[1])), "parameter gradients"
    fsdp_experts(ref, x, grad, rank)
    print(f"rank {rank}: ok")


def fsdp_experts(ref, x, grad, rank: int) -> None:
    """As train.py shards it under expert parallel: the experts an FSDP2 unit of their own inside the layer's, whose
    hooks run inside the recomputed region and enter record_function a different number of times there (torch's
    selective checkpointing then failed: "invocation index 2 ... not found in storage"); bitwise no checkpointing."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from internlm_core.parallel import checkpoint_and_compile

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("ep", "fsdp"))["fsdp"]
    results = {}
    for setting in (False, "selective"):
        layer = copy.deepcopy(ref)
        layer.set_expert_parallel(None, 2, rank)
        fully_shard(layer.experts, mesh=mesh)
        fully_shard(layer, mesh=mesh)
        checkpoint_and_compile([layer], setting, compile=False)
        x_grad, calls = _backward_counting(layer, x, grad, seed=1000 + rank)
        results[setting] = (x_grad, [p.grad.to_local() for p in layer.parameters()], calls)
    none, selective = results[False], results["selective"]
    assert none[2] == selective[2] == 2, (none[2], selective[2])
    assert torch.equal(selective[0], none[0]), "input gradient (FSDP2 experts)"
    assert all(torch.equal(a, b) for a, b in zip(selective[1], none[1])), "parameter gradients (FSDP2 experts)"


if __name__ == "__main__":
    main()
