"""Muon under FSDP2, tensor parallel 2 and expert parallel 2 on two gloo ranks (this file is also the driver each rank
runs): 20 steps of the same gradients give the parameters of single-process Muon to 1e-6, each matrix orthogonalized
whole; torch.optim.Muon applied to each rank's shard does not (the check this test makes would fail it); the
optimizer state saved (DCP) under FSDP2 after 10 steps resumes under tensor parallel and continues as one process; qk-clip under FSDP2 (each rank's logits maximized over both) scales W_q / W_k as one process
does over both ranks' rows.

The toy model holds every kind the split meets: an embedding, biases and a norm (AdamW), 2-D weights cut by rows and
by columns, a 2-D weight with an odd row count (uneven FSDP2 shards), and a 3-D expert weight [E, rows, columns]
(Muon per expert; expert parallel shards it by expert, tensor parallel by rows)."""

from __future__ import annotations

import pytest

from tests.helpers.launch import ROOT, env

pytestmark = pytest.mark.slow

STEPS, SAVE_AT = 20, 10
HIDDEN = ("up.weight", "down.weight", "odd", "experts")  # Muon's; the rest AdamW's
TOL = 1e-6


def test_muon_fsdp_tp_ep_equal_one_process():
    from tests.helpers import warm
    p = warm.run(str(ROOT / "tests/dist/test_muon_dist.py"), [], env(), ROOT, timeout=300, nproc=2)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert p.stdout.count(": ok") == 2, p.stdout
    for line in p.stdout.splitlines():  # rank 0's figures, for the record
        if line.startswith("rank 0 "):
            print(line)


def test_muon_fsdp2_over_tp2_equals_one_process():
    """4 ranks: tensor parallel 2 inside FSDP2 2 (the weights' placements on the 2-D mesh, FSDP2's _StridedShard
    where both cut the same dim)."""
    from tests.helpers import warm
    p = warm.run(str(ROOT / "tests/dist/test_muon_dist.py"), ["dp2_tp2"], env(), ROOT, timeout=300, nproc=4)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert p.stdout.count(": ok") == 4, p.stdout
    print("\n".join(line for line in p.stdout.splitlines() if line.startswith("rank 0 ")))


def toy():
    import torch
    import torch.nn as nn

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(11, 6)
            self.up = nn.Linear(6, 10)              # weight [10, 6], bias [10]
            self.down = nn.Linear(10, 6, bias=False)  # weight [6, 10]
            self.norm = nn.RMSNorm(6)
            self.odd = nn.Parameter(torch.randn(7, 5))       # 7 rows: shards of 4 and 3
            self.experts = nn.Parameter(torch.randn(4, 5, 6))  # 4 experts of [5, 6]

    torch.manual_seed(0)
    return Toy()


def muon_of(model, cls=None):
    from internlm_core.optim.muon import Muon
    hidden = [model.up.weight, model.down.weight, model.odd, model.experts]
    ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return Muon([{"params": hidden, "use_muon": True}, {"params": rest}], lr=0.02, weight_decay=0.1)


def grads(step: int, names) -> dict:
    import torch
    g = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(shape, generator=g) for n, shape in names}


def set_grads(model, step: int) -> None:
    """The same full gradient on every rank and layout; a DTensor parameter gets its own shard of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    full = grads(step, [(n, p.shape) for n, p in model.named_parameters()])
    for n, p in model.named_parameters():
        g = full[n]
        p.grad = (distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
                  if isinstance(p, DTensor) else g.clone())


def full_params(model) -> dict:
    from torch.distributed.tensor import DTensor
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


def layout(name: str, mesh):
    """A fresh toy model in layout `name` on `mesh` (1-D, two ranks)."""
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    model = toy()
    if name == "dp2_tp2":  # mesh 2 x 2 ("dp", "tp"): tensor parallel first, then FSDP2 over dp
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    elif name == "fsdp2":
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
    elif name == "tp2":
        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        model.experts = nn.Parameter(distribute_tensor(model.experts.detach(), mesh, [Shard(1)]))  # rows cut
        model.odd = nn.Parameter(distribute_tensor(model.odd.detach(), mesh, [Shard(1)]))  # columns cut, 3 and 2
    elif name == "ep2":
        model.experts = nn.Parameter(distribute_tensor(model.experts.detach(), mesh, [Shard(0)]))  # 2 experts each
    return model


def run_steps(model, opt, start: int, stop: int, ref_states: dict, diffs: list) -> None:
    for step in range(start, stop):
        set_grads(model, step)
        opt.step()
        diffs.append(max_diff(full_params(model), ref_states[step]))


def reference() -> dict:
    """Single-process Muon: the full parameters after each step."""
    model = toy()
    opt = muon_of(model)
    states = {}
    for step in range(STEPS):
        set_grads(model, step)
        opt.step()
        states[step] = full_params(model)
    return states


def torch_muon_per_shard(mesh, ref_states: dict) -> float:
    """torch.optim.Muon (Moonlight's scaling) on each rank's local shards of the FSDP2 layout's matrices: the largest
    ||w - w_one_process|| / ||w_one_process - w_0|| of a matrix after 3 steps."""
    import torch
    model = layout("fsdp2", mesh)
    hidden = [model.up.weight, model.down.weight, model.odd]  # 2-D only: torch's Muon refuses the 3-D experts
    local = [torch.nn.Parameter(p.to_local()) for p in hidden]  # shares the shards' storage
    opt = torch.optim.Muon(local, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for step in range(3):
        set_grads(model, step)
        for lp, p in zip(local, hidden):
            lp.grad = p.grad.to_local()
        opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    full, start = full_params(model), full_params(toy())
    worst = 0.0
    for n in (names[id(p)] for p in hidden):  # the error relative to the update one process made
        worst = max(worst, ((full[n] - ref_states[2][n]).norm() / (ref_states[2][n] - start[n]).norm()).item())
    return worst


def resume_across_layouts(mesh, ref_states: dict, folder: str) -> list:
    """SAVE_AT steps under FSDP2, saved with DCP; loaded under tensor parallel; on to STEPS."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)
    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    model = layout("fsdp2", mesh)
    opt = muon_of(model)
    run_steps(model, opt, 0, SAVE_AT, ref_states, [])
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt, options=opts)},
             checkpoint_id=folder)
    model2 = layout("tp2", mesh)
    opt2 = muon_of(model2)
    sd = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2, options=opts)}
    dcp.load(sd, checkpoint_id=folder)
    set_model_state_dict(model2, sd["model"])
    set_optimizer_state_dict(model2, opt2, sd["optim"], options=opts)
    assert opt2.state[model2.up.weight]["momentum_buffer"].placements == model2.up.weight.placements
    diffs = []
    run_steps(model2, opt2, SAVE_AT, STEPS, ref_states, diffs)
    return diffs


def qk_clip_fsdp(mesh) -> float:
    """optimizer.muon_qk_clip under FSDP2: each rank records its own rows' logits, the clip maximizes them over the
    ranks and scales its shard of W_q / W_k as one process scales the whole rows after a forward over both ranks'
    rows. Returns the largest difference of the clipped W_q / W_k from one process's."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from internlm_core.model import build_model
    from internlm_core.model.qk_clip import install_logit_records
    from internlm_core.optim.muon import Muon, qk_clip
    from tests.unit.test_model import small_cfg

    torch.manual_seed(0)
    one = build_model(small_cfg("LLAMA", kv=2, num_layers=1, hidden_size=64, num_attention_heads=4, multiple_of=16))
    with torch.no_grad():
        one.layers["0"].attention.wq.weight[:16] *= 8  # head 0's logits far above the rest
    sharded = copy.deepcopy(one)
    ids = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(3))
    tau = 0.05
    for model, rows in ((one, ids), (sharded, ids[2 * dist.get_rank():2 * dist.get_rank() + 2])):
        heads = install_logit_records(model)
        if model is sharded:
            fully_shard(model.layers["0"], mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = Muon([{"params": [p for p in model.parameters() if p.dim() >= 2], "use_muon": True}], lr=0.0,
                   clip=lambda heads=heads: qk_clip(heads, tau))
        model(rows).float().pow(2).mean().backward()
        opt.step()
        assert opt.last_clipped >= 1, opt.last_clipped
    diff = 0.0
    for name in ("wq", "wk"):
        a = getattr(one.layers["0"].attention, name).weight
        b = getattr(sharded.layers["0"].attention, name).weight.full_tensor()
        diff = max(diff, float((a - b).abs().max()))
    return diff


def main() -> None:
    import sys
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from internlm_core.optim.muon import matrices_are_cut
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ref = reference()
    if sys.argv[1:] == ["dp2_tp2"]:
        model = layout("dp2_tp2", init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
        placements = {n: p.placements for n, p in model.named_parameters() if n in HIDDEN[:2]}
        diffs = []
        run_steps(model, muon_of(model), 0, STEPS, ref, diffs)
        print(f"rank {rank} dp2_tp2: max |w - w_one_process| over {STEPS} steps {max(diffs):.3g} ({placements})")
        assert max(diffs) <= TOL, diffs
        print(f"rank {rank}: ok")
        return
    mesh = init_device_mesh("cpu", (2,))
    for name in ("fsdp2", "tp2", "ep2"):
        model = layout(name, mesh)
        cut = sorted(n for n, p in model.named_parameters() if matrices_are_cut(p) and n in HIDDEN)
        diffs = []
        run_steps(model, muon_of(model), 0, STEPS, ref, diffs)
        print(f"rank {rank} {name}: max |w - w_one_process| over {STEPS} steps {max(diffs):.3g} "
              f"(gathered whole: {', '.join(cut) or 'none'})")
        assert max(diffs) <= TOL, (name, diffs)
    shard_diff = torch_muon_per_shard(mesh, ref)
    print(f"rank {rank} torch.optim.Muon per FSDP2 shard: after 3 steps |w - w_one_process| is {shard_diff:.1%} of "
          "one process's update")
    assert shard_diff > 0.05, shard_diff  # far outside the 1e-6 the layouts above keep
    folder = [tempfile.mkdtemp(prefix="muon_dcp_") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    diffs = resume_across_layouts(mesh, ref, folder[0])
    print(f"rank {rank} saved at fsdp2 step {SAVE_AT}, resumed at tp2: max |w - w_one_process| to step {STEPS} "
          f"{max(diffs):.3g}")
    assert max(diffs) <= TOL, diffs
    clip_diff = qk_clip_fsdp(mesh)
    print(f"rank {rank} qk-clip under fsdp2: max |w - w_one_process| of W_q, W_k {clip_diff:.3g}")
    assert clip_diff <= TOL, clip_diff
    dist.barrier()
    print(f"rank {rank}: ok")


if __name__ == "__main__":
    main()
