"""Driver (gloo, 2 or 4 ranks) of tests/dist/test_cuda_autocast_layouts.py: the dtype policy (numerics/precision.py)
under CUDA's autocast norm rule emulated on the CPU (tests/helpers/cuda_autocast.py).

    python tests/dist/cuda_autocast_driver.py context 2|4   QWEN3 / QWEN3_MoE under ring and all_to_all (2 ranks),
                                                             ring, all_to_all and 2d 2x2 (4 ranks)
    python tests/dist/cuda_autocast_driver.py router 2      the MoE gate under FSDP's bf16 policy

context: bf16 parameters (what FSDP's policy gathers) under bf16 autocast with CUDA's norm rule, forward on each
rank's zigzag chunk, backward outside autocast (as the trainer runs it). Every norm returns its input's dtype,
q/k/v reach attention in one dtype, and the logits and gradients are those of the same model on whole rows (bf16:
to 2% of the largest entry). router: QWEN3_MoE parallelized by parallelize_model over FSDP with model.dtype bf16:
the gate's weight is gathered in fp32 and its logits equal F.linear of the input with the fp32 weight exactly,
while the blocks' other weights are gathered in bf16. Prints "rank N: ok".
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import internlm_core.model.internlm.model as internlm_model  # noqa: E402
from internlm_core.config import load_config  # noqa: E402
from internlm_core.distributed import ParallelDims  # noqa: E402
from internlm_core.model import build_model, model_spec  # noqa: E402
from internlm_core.model.context import ContextGroup, make_inner_group, set_context_parallel, zigzag_indices  # noqa: E402
from internlm_core.model.layers import RMSNorm  # noqa: E402
from internlm_core.model.moe.router import Router  # noqa: E402
from internlm_core.numerics import resolve_precision  # noqa: E402
from internlm_core.parallel import fsdp_wraps, parallel_options, parallelize_model  # noqa: E402
from internlm_core.utils import collectives  # noqa: E402
from tests.helpers.cuda_autocast import cuda_norm_rules  # noqa: E402

B, T = 2, 32


def tiny(model_type: str, *extra: str, world_size: int = 1):
    # every expert chosen (top-k of 4 = 4): bf16 rounding in another order cannot flip a token's choice, so the
    # layouts stay comparable; the router, dispatch, expert GEMMs and combine all run
    moe = ["model.num_experts=4", "moe.top_k=4", "model.moe_type=Dropless"] if "MoE" in model_type else []
    return load_config("configs/tiny.py", [f"model_type={model_type}", f"data.seq_len={T}", "model.num_layers=2",
                                           "model.hidden_size=64", "model.num_attention_heads=4",
                                           "model.num_kv_attention_heads=2", "model.head_dim=16", *moe, *extra],
                       world_size=world_size)


def documents(seed: int) -> torch.Tensor:
    """[B, T] document ids: documents of 1 to 12 tokens, straddling the chunks' borders."""
    g = torch.Generator().manual_seed(seed)
    rows, nxt = [], 0
    for _ in range(B):
        ids: list[int] = []
        while len(ids) < T:
            ids += [nxt] * int(torch.randint(1, 13, (1,), generator=g))
            nxt += 1
        rows.append(torch.tensor(ids[:T]))
    return torch.stack(rows)


def positions(doc: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(doc)
    for b in range(doc.shape[0]):
        for i in range(1, doc.shape[1]):
            out[b, i] = out[b, i - 1] + 1 if doc[b, i] == doc[b, i - 1] else 0
    return out


def run(model, ids, pos, doc, weight):
    """Forward under bf16 autocast with CUDA's norm rule, backward outside autocast; (logits, {name: grad})."""
    with cuda_norm_rules(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids, pos, document_ids=doc)
    (logits.float() * weight).sum().backward()
    return logits.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def check_context(ctx: ContextGroup, model_type: str) -> None:
    tag = f"{model_type} {ctx.mode} C={ctx.size}"
    torch.manual_seed(0)
    whole = build_model(tiny(model_type), attn_backend="cpu_blocked").to(torch.bfloat16)  # FSDP's gathered dtype
    part = copy.deepcopy(whole)
    set_context_parallel(part, ctx)
    seen, norms = [], []
    for m in part.modules():
        if isinstance(m, RMSNorm):
            m.register_forward_hook(lambda mod, inp, out: norms.append((inp[0].dtype, out.dtype)))
    real = internlm_model.attention
    internlm_model.attention = lambda q, k, v, *a: seen.append((q.dtype, k.dtype, v.dtype)) or real(q, k, v, *a)
    try:
        ids = torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(3))
        doc = documents(5)
        pos = positions(doc)
        weight = torch.randn(B, T, 512, generator=torch.Generator().manual_seed(4))
        zig = zigzag_indices(T, ctx.size, ctx.rank)
        local, grads = run(part, ids[:, zig], pos[:, zig], doc[:, zig], weight[:, zig])
    finally:
        internlm_model.attention = real
    assert norms and all(i == o for i, o in norms), f"{tag}: a norm changed its input's dtype: {set(norms)}"
    assert seen and all(len(set(d)) == 1 for d in seen), f"{tag}: q/k/v dtypes at attention {set(seen)}"
    logits, want = run(whole, ids, pos, doc, weight)
    err = ((local - logits[:, zig]).abs().max() / logits.abs().max()).item()
    assert err < 0.02, f"{tag}: logits off by {err:.4f} of the largest"
    for name, g in grads.items():
        g = g.clone()
        collectives.all_reduce(g, group=ctx.group)  # each rank holds its tokens' share of the gradient
        assert torch.isfinite(g).all(), f"{tag}: gradient of {name} not finite"
        err = ((g - want[name]).abs().max() / want[name].abs().max().clamp_min(1e-12)).item()
        assert err < 0.05, f"{tag}: gradient of {name} off by {err:.4f} of the largest"


def check_router(world: int) -> None:
    """The gate's logits under FSDP's bf16 policy equal the fp32 computation."""
    cfg = tiny("QWEN3_MoE", "model.dtype=torch.bfloat16", world_size=world)
    dims = ParallelDims.from_config(cfg.parallel, world)
    dims.build_mesh("cpu")
    assert fsdp_wraps(dims)
    precision = resolve_precision(cfg.model.dtype, "cpu").under_fsdp(fsdp_wraps(dims))
    assert not precision.uses_autocast  # FSDP's policy is the only cast
    model, _ = parallelize_model(build_model(cfg, "meta"), model_spec(cfg), parallel_options(cfg), dims,
                                 torch.device("cpu"), precision=precision)
    routers = [m for m in model.modules() if isinstance(m, Router)]
    gathered, calls = {}, []
    for r in routers:
        r.register_forward_pre_hook(lambda m, a: gathered.setdefault("gate", m.weight.dtype) and None)
        r.register_forward_hook(lambda m, a, out: calls.append((m, a[0].detach(), out.detach())))
    wq = next(m for n, m in model.named_modules() if n.endswith("attention.wq"))
    wq.register_forward_pre_hook(lambda m, a: gathered.setdefault("wq", m.weight.dtype) and None)
    ids = torch.randint(0, cfg.model.vocab_size, (2, T), generator=torch.Generator().manual_seed(dist.get_rank()))
    with precision.autocast():
        logits = model(ids)
    logits.float().square().mean().backward()
    assert gathered == {"gate": torch.float32, "wq": torch.bfloat16}, gathered
    assert len(calls) == len(routers) == 2
    for router, x, out in calls:
        full = router.weight.full_tensor()  # the fp32 master weight
        assert full.dtype == torch.float32 and out.dtype == torch.float32
        assert torch.equal(out, F.linear(x.float(), full)), "gate logits differ from the fp32 computation"
        assert not torch.equal(out, F.linear(x.float(), full.bfloat16().float()))  # what a bf16 gather gives
        assert router.weight.grad is not None and router.weight.grad.dtype == torch.float32


def main(what: str, nproc: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if what == "router":
        check_router(nproc)
    else:
        world = dist.group.WORLD
        contexts = [ContextGroup(world, nproc, rank, "ring"), ContextGroup(world, nproc, rank, "all_to_all")]
        if nproc == 4:
            contexts = [ContextGroup(world, 4, rank, "2d", inner=2)] + contexts
        for ctx in contexts:
            make_inner_group(ctx)
            for model_type in ("QWEN3", "QWEN3_MoE"):
                check_context(ctx, model_type)
    print(f"rank {rank}: ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
