"""Expert parallel 2 on two gloo ranks (this file is also the driver each rank runs): each rank routes its own batch,
sends the rows to the rank holding their expert with all_to_all_single (uneven splits) and combines the results.
Against the single-process layer with all experts on each rank's batch: outputs and input gradients to 1e-6, the
router's gradient that of the rank's own batch, and each local expert's weight gradient the sum of both ranks'
contributions. Cases: dropless; GShard with capacity drops and random token selection (the same drops as the
reference given each rank's seed); experts as DTensors Shard(0) with grouped GEMMs; a rank whose experts get no rows.
Each forward and backward reads the device on the host once (tests/helpers/host_syncs.py): the count matrix.
"""

from __future__ import annotations

import copy

import pytest

from tests.helpers.launch import ROOT, env

pytestmark = pytest.mark.slow

TOL = dict(atol=1e-6, rtol=1e-6)


def test_expert_parallel_2_matches_one_process():
    from tests.helpers import warm
    p = warm.run(str(ROOT / "tests/dist/test_moe_dispatch.py"), [], env(), ROOT, timeout=120, nproc=2)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert p.stdout.count(": ok") == 2, p.stdout


def batch(rank: int, h: int, case: str):
    """Rank `rank`'s input and output-gradient (different sizes on the two ranks: uneven all-to-all splits)."""
    import torch
    g = torch.Generator().manual_seed(100 + rank)
    shape = (2, 5, h) if rank == 0 else (3, 3, h)
    x = torch.randn(shape, generator=g)
    if case == "starved":  # everything to experts 0 and 1 (rank 0's): rank 1's experts get no rows
        x[..., 0] += 4.0
        x[..., 1] += 4.0
    return x, torch.randn(shape, generator=g)


def run(layer, x, grad, seed: int):
    """Forward (the device RNG seeded: random token selection) and backward of sum(out * grad); (out, x.grad)."""
    import torch
    torch.manual_seed(seed)
    x = x.clone().requires_grad_()
    out = layer(x)
    (out * grad).sum().backward()
    return out.detach(), x.grad


def check_case(case: str, rank: int) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from internlm_core.model.moe import MoEArgs, MoEFeedForward, grouped_mm_available
    from tests.helpers.host_syncs import HostSyncs

    h = 16
    kw = dict(num_experts=4, top_k=2, ffn_width=8, aux_loss_coeff=0.01, z_loss_coeff=0.001)
    kw.update({"dropless": dict(moe_type="Dropless"), "starved": dict(moe_type="Dropless"),
               "capacity": dict(moe_type="GShard", top_k=1, capacity_factor=0.75, min_capacity=0, use_rts=True,
                                norm_topk_prob=False),
               "dtensor": dict(moe_type="Dropless", expert_gemm="grouped")}[case])
    torch.manual_seed(0)
    ref = MoEFeedForward(h, MoEArgs(**kw), init_std=0.2)
    if case == "starved":
        with torch.no_grad():
            ref.gate.weight.zero_()
            ref.gate.weight[0, 0] = ref.gate.weight[1, 1] = 1.0
    ep = copy.deepcopy(ref)
    if case == "dtensor":  # the lead's layout: Shard(0) over the expert-parallel mesh, then set_expert_parallel
        mesh = init_device_mesh("cpu", (2,))
        for name in ("w1", "w3", "w2"):
            full = getattr(ep.experts, name)
            setattr(ep.experts, name, torch.nn.Parameter(distribute_tensor(full.detach(), mesh, [Shard(0)])))
    ep.set_expert_parallel(None, 2, rank)

    x, grad = batch(rank, h, case)
    grouped_mm_available(x.device, x.dtype)  # the grouped GEMM's one-time probe, not part of a forward
    with HostSyncs(torch.device("cpu")) as syncs:
        out, x_grad = run(ep, x, grad, seed=1000 + rank)
    # one host sync per forward and backward: the copy of the sent and received row counts
    assert syncs.events == [("d2h", "tolist")], (case, syncs.sites)
    ref_out, ref_x_grad = run(ref, x, grad, seed=1000 + rank)
    ref_gate_grad = ref.gate.weight.grad.clone()
    other_x, other_grad = batch(1 - rank, h, case)
    run(ref, other_x, other_grad, seed=1000 + (1 - rank))  # ref's expert grads: both ranks' contributions

    torch.testing.assert_close(out, ref_out, **TOL, msg=f"{case}: output")
    torch.testing.assert_close(x_grad, ref_x_grad, **TOL, msg=f"{case}: input gradient")
    torch.testing.assert_close(ep.gate.weight.grad, ref_gate_grad, **TOL, msg=f"{case}: router gradient")
    local = slice(2 * rank, 2 * rank + 2)
    for name in ("w1", "w3", "w2"):
        g = getattr(ep.experts, name).grad
        if case == "dtensor":
            assert g.placements == (Shard(0),), g.placements
            g = g.to_local()
        torch.testing.assert_close(g, getattr(ref.experts, name).grad[local], **TOL, msg=f"{case}: experts.{name}")
    stats = ep.last_stats
    if case == "capacity":
        assert stats.dropped_fraction.item() > 0, "the capacity case should drop tokens"
    if case == "starved" and rank == 1:
        assert stats.tokens_per_expert[2:].sum().item() == 0
        assert ep.experts.w1.grad.abs().max().item() == 0.0


def main() -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for case in ("dropless", "capacity", "dtensor", "starved"):
        check_case(case, rank)
    print(f"rank {rank}: ok")


if __name__ == "__main__":
    main()
