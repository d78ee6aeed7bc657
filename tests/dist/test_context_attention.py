"""Context-parallel attention on real gloo ranks (this file is also the driver each rank runs).

Every rank draws the same whole rows (q, k, v, the output gradient, the document ids), keeps its zigzag chunk and
runs `context_attention`; its output and its chunk's dq / dk / dv must equal the whole-sequence reference
(`blocked_causal_attention` under the document masks, autograd) at the chunk's positions, fp32 to 1e-5. Cases:
rows of many short documents and rows of one document, grouped-query attention (4 query heads over 2 and 1 k/v
heads: the all-to-all over 4 ranks repeats them), a sliding window of 11 keys, the bytes each rank counted equal
`predicted_context_bytes`.
2 ranks: ring and all_to_all, also under activation checkpointing and (forward) under the device audit, as if
on CUDA (a host tensor in a collective fails); the InternLM Transformer under `set_context_parallel` against the
same model on whole rows (logits and every parameter's gradient summed over the ranks). 4 ranks: ring, all_to_all
and 2d (2 x 2) over the world, and ring / all_to_all over 2-rank groups {0, 2} and {1, 3} of the 4.
"""

from __future__ import annotations

import sys

import pytest

from tests.helpers.launch import ROOT, env

pytestmark = pytest.mark.slow

TOL = dict(atol=1e-5, rtol=1e-5)


def _run(nproc: int) -> None:
    from tests.helpers import warm
    p = warm.run(str(ROOT / "tests/dist/test_context_attention.py"), [str(nproc)], env(), ROOT, timeout=240,
                 nproc=nproc)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert p.stdout.count(": ok") == nproc, p.stdout


def test_context_attention_2_ranks_ring_and_all_to_all_and_the_model():
    _run(2)


def test_context_attention_4_ranks_ring_all_to_all_2d_and_subgroups():
    _run(4)


def documents(layout: str, B: int, T: int, seed: int):
    """int64 [B, T] document ids as the trainer makes them (increasing over the micro-batch): "short" rows of
    many documents of 1 to 12 tokens (they straddle chunk borders), "long" rows of one document."""
    import torch
    g = torch.Generator().manual_seed(seed)
    rows, next_id = [], 0
    for _ in range(B):
        if layout == "long":
            rows.append(torch.full((T,), next_id))
            next_id += 1
            continue
        ids = []
        while len(ids) < T:
            ids += [next_id] * int(torch.randint(1, 13, (1,), generator=g))
            next_id += 1
        rows.append(torch.tensor(ids[:T]))
    return torch.stack(rows)


def reference(q, k, v, dout, doc, window=None):
    """Whole-row attention and its input gradients, by autograd through the plain blocked kernel."""
    import torch
    from internlm_core.model.attention import block_document_masks, blocked_causal_attention
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = blocked_causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                   masks=block_document_masks(doc, window=window)).transpose(1, 2)
    return (out.detach(), *torch.autograd.grad((out * dout).sum(), (q, k, v)))


def check_attention(ctx, layout: str, hkv: int, tag: str, device=None, checkpointed: bool = False,
                    window=None, backend=None) -> None:
    """device: the device audit's (tests/helpers/device_audit.py): every tensor a collective gets must be on it;
    forward only there (autograd's saved tensors come back unmarked, which the backward's shifts would refuse; they
    send buffers made like the forward's). backend: context_attention's ("varlen_contract": the varlen plumbing on
    the GPU kernels' CPU contract; None: the blockwise core)."""
    import torch
    from internlm_core.model.context import (build_context_meta, context_attention, pop_context_bytes,
                                             predicted_context_bytes, zigzag_indices)
    C = ctx.size
    B, T, H, D = 2, 16 * C, 4, 8
    g = torch.Generator().manual_seed(100 * C + 10 * hkv + len(layout))  # the same on every rank
    q, dout = torch.randn(B, T, H, D, generator=g), torch.randn(B, T, H, D, generator=g)
    k, v = torch.randn(B, T, hkv, D, generator=g), torch.randn(B, T, hkv, D, generator=g)
    doc = documents(layout, B, T, seed=C)
    want = reference(q, k, v, dout, doc, window)
    zig = zigzag_indices(T, C, ctx.rank)
    device = device or torch.device("cpu")
    ql, kl, vl = (x[:, zig].to(device).requires_grad_() for x in (q, k, v))
    pop_context_bytes()
    ids = doc[:, zig] if device.type == "cpu" else doc[:, zig].to(device)  # the audit cannot pin host memory
    meta = build_context_meta(ctx, ids, B, T // C, device, window)
    if checkpointed:  # activation checkpointing: the backward runs the forward's exchanges again first
        from torch.utils.checkpoint import checkpoint
        out = checkpoint(context_attention, ql, kl, vl, meta, backend, use_reentrant=False)
    else:
        out = context_attention(ql, kl, vl, meta, backend)
    if device.type != "cpu":
        torch.testing.assert_close(out.cpu(), want[0][:, zig], **TOL, msg=lambda m: f"{tag} {layout}: {m}")
        return
    (out * dout[:, zig]).sum().backward()
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad), want):
        torch.testing.assert_close(got.cpu(), ref[:, zig], **TOL, msg=lambda m: f"{tag} {layout} hkv={hkv} {name}: {m}")
    sent = pop_context_bytes()
    if checkpointed:
        return
    expect = predicted_context_bytes(ctx.mode, C, ctx.inner, B, T, H, hkv, D, 4, layers=1)
    assert sent[ctx.mode] == expect > 0, (tag, sent, expect)
    assert sent["layout"] == B * (T // C) * 8 * (C - 1), (tag, sent)


def check_model(ctx, window=None) -> None:
    """The InternLM Transformer on its zigzag chunks under set_context_parallel equals the model on whole rows
    (`window`: model.sliding_window, keys per query)."""
    import copy

    import torch
    from internlm_core.model import ModelArgs, Transformer
    from internlm_core.model.context import set_context_parallel, zigzag_indices
    from internlm_core.utils import collectives
    C, B, T = ctx.size, 2, 32
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_width=48,
                     max_seqlen=T, attn_backend="cpu_blocked", init_std=0.1, sliding_window=window)
    whole = Transformer(args)
    part = copy.deepcopy(whole)
    set_context_parallel(part, ctx)
    ids = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(3))
    doc = documents("short" if window is None else "long", B, T, seed=5)
    pos = _positions(doc)
    logits = whole(ids, pos, document_ids=doc)
    (logits ** 2).sum().backward()
    zig = zigzag_indices(T, C, ctx.rank)
    local = part(ids[:, zig], pos[:, zig], document_ids=doc[:, zig])
    (local ** 2).sum().backward()
    torch.testing.assert_close(local, logits[:, zig], **TOL, msg=lambda m: f"model logits: {m}")
    for (name, p), (_, w) in zip(part.named_parameters(), whole.named_parameters()):
        grad = p.grad.clone()
        collectives.all_reduce(grad, group=ctx.group)  # each rank holds its tokens' share of the gradient
        scale = w.grad.abs().max().item()  # fp32 sums in another order: to 1e-5 of the gradient's size
        torch.testing.assert_close(grad, w.grad, atol=1e-5 * scale, rtol=1e-5,
                                   msg=lambda m: f"model grad {name} (max {scale:.3g}): {m}")


def _positions(doc):
    """Position of each token in its document, per row."""
    import torch
    out = torch.zeros_like(doc)
    for b in range(doc.shape[0]):
        for i in range(1, doc.shape[1]):
            out[b, i] = out[b, i - 1] + 1 if doc[b, i] == doc[b, i - 1] else 0
    return out


def main(nproc: int) -> None:
    import torch.distributed as dist
    from internlm_core.model.context import ContextGroup, make_inner_group
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = dist.group.WORLD
    contexts = [ContextGroup(world, nproc, rank, "ring"), ContextGroup(world, nproc, rank, "all_to_all")]
    if nproc == 4:
        contexts.append(ContextGroup(world, 4, rank, "2d", inner=2))
        subgroups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates both, in order
        mine = subgroups[rank % 2]
        contexts += [ContextGroup(mine, 2, rank // 2, "ring"), ContextGroup(mine, 2, rank // 2, "all_to_all")]
    for i, ctx in enumerate(contexts):
        make_inner_group(ctx)
        tag = f"{ctx.mode} C={ctx.size} #{i}"
        for layout, hkv in (("short", 2), ("long", 2), ("short", 1), ("short", 4)):
            check_attention(ctx, layout, hkv, tag)
        check_attention(ctx, "long", 2, tag + " window 11", window=11)  # a sliding window (Mistral)
        for layout, hkv, window in (("short", 2, None), ("long", 1, None), ("short", 4, 5), ("long", 2, 11)):
            check_attention(ctx, layout, hkv, f"{tag} varlen window {window}", window=window,
                            backend="varlen_contract")  # the varlen plumbing: ring shifts, a2a, LSE merge
    if nproc == 2:
        check_model(contexts[0])
        for ctx in contexts:  # a sliding window (Mistral) shorter than the documents, through the model
            check_model(ctx, window=5)
        for ctx in contexts:
            check_attention(ctx, "short", 2, f"{ctx.mode} checkpointed", checkpointed=True)
        from tests.helpers.device_audit import audit_devices
        with audit_devices("cuda") as device:  # every tensor of every collective on the run's device
            for ctx in contexts:
                check_attention(ctx, "short", 2, f"{ctx.mode} audited", device)
    print(f"rank {rank}: ok")


if __name__ == "__main__":
    main(int(sys.argv[1]))
