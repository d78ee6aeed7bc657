"""GPU check row (bench/gpu_rows.py): torch's FA2 varlen kernels against their CPU contract
(internlm_core/model/context/varlen.py), and the paths built on them.

1. The kernel alone: `aten._flash_attention_forward/backward` in bf16 against `contract_forward/backward` in fp32 on
   the same bf16 values: causal, causal with a window, fully visible with a left window (left, -1), no mask, segments
   of unequal query and key lengths (bottom-right alignment), grouped-query heads; out, lse and the gradients from
   the kernel's own out and lse, each within its allowance (gpu_rows_numerics.tensor_errors).
2. The varlen plumbing of a 4-rank ring, step by step on one GPU (no communication): every rank's out, dq, dk, dv on
   the kernel against the contract.
3. The packed-rows path `attn_backend="torch_varlen"` (varlen_attn) against sdpa in fp32.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gpu_rows_numerics import compare_attention, format_errors, tensor_errors

CUDA = torch.device("cuda", 0)
CASES = {  # name: (causal, window, query lengths, key lengths, k/v heads)
    "causal": (True, (-1, 0), (300, 1, 700, 23), (300, 1, 700, 23), 4),
    "causal window 64": (True, (63, 0), (300, 1, 700, 23), (300, 1, 700, 23), 2),
    "visible, left 40": (False, (40, -1), (128, 256, 64), (256, 256, 300), 4),
    "no mask, unequal": (False, (-1, -1), (100, 5, 400), (333, 64, 7), 1),
    "causal, unequal": (True, (-1, 0), (100, 50, 400), (333, 64, 700), 8),
}


def _bf16_values(*shape: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(torch.bfloat16).float().to(CUDA)


def _kernel_case(causal, window, lq, lk, hkv, H: int = 8, D: int = 64) -> tuple[bool, str]:
    from internlm_core.model.context.varlen import VarlenCall, contract_backward, contract_forward, kernel_backward
    from internlm_core.model.context.varlen import kernel_forward
    g = torch.Generator().manual_seed(len(lq) + hkv)
    cu_q = torch.tensor([0, *lq]).cumsum(0).to(torch.int32).to(CUDA)
    cu_k = torch.tensor([0, *lk]).cumsum(0).to(torch.int32).to(CUDA)
    q, dout = _bf16_values(sum(lq), H, D, g=g), _bf16_values(sum(lq), H, D, g=g)
    k, v = _bf16_values(sum(lk), hkv, D, g=g), _bf16_values(sum(lk), hkv, D, g=g)
    call = VarlenCall(torch.arange(sum(lq), device=CUDA), torch.arange(sum(lk), device=CUDA), cu_q, cu_k, max(lq),
                      max(lk), causal, window)
    b = [t.to(torch.bfloat16) for t in (q, k, v, dout)]
    out, lse = kernel_forward("aten_flash", *b[:3], call)
    grads = kernel_backward("aten_flash", b[3], *b[:3], out, lse, call)
    ref_out, ref_lse = contract_forward(q, k, v, cu_q, cu_k, max(lq), max(lk), None, causal, window)
    # the reference gradients from the kernel's own out and lse (what the ring hands the backward)
    ref = contract_backward(dout, q, k, v, out.float(), lse, cu_q, cu_k, max(lq), max(lk), None, causal, window)
    got = dict(zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)))
    ok, report = tensor_errors(got, dict(zip(("out", "lse", "dq", "dk", "dv"), (ref_out, ref_lse, *ref))))
    shapes = lse.shape == (H, sum(lq)) and lse.dtype == torch.float32
    return ok and shapes, format_errors(report) + ("" if shapes else f"; lse {tuple(lse.shape)} {lse.dtype}")


def _ring_steps(window, hkv: int = 2, C: int = 4, B: int = 2, H: int = 8, D: int = 64) -> tuple[bool, str]:
    """Every rank of a C-rank ring, its steps run on one GPU: the kernel's plumbing against the contract's."""
    from internlm_core.model.context.layout import _tokens
    from internlm_core.model.context.varlen import plan_calls, step_backward, step_forward
    T = 256 * C
    g = torch.Generator().manual_seed(5)
    doc = torch.cumsum((torch.rand(B, T, generator=g) < 0.003).long(), 1).to(CUDA)
    worst, ok = {}, True
    for rank in range(C):
        query = _tokens([rank], T, C, doc, doc.cpu())
        sources = [_tokens([(rank - s) % C], T, C, doc, doc.cpu()) for s in range(C)]
        n = B * len(query.index)
        q, dout = _bf16_values(n, H, D, g=g), _bf16_values(n, H, D, g=g)
        kvs = [(_bf16_values(n, hkv, D, g=g), _bf16_values(n, hkv, D, g=g)) for _ in sources]
        calls = [plan_calls(query, src, window, CUDA) for src in sources]
        res = {}
        for kernel, dt in (("aten_flash", torch.bfloat16), ("contract", torch.float32)):
            out = torch.zeros(H, n, D, device=CUDA)
            lse = torch.full((H, n), float("-inf"), device=CUDA)
            for (k, v), step in zip(kvs, calls):
                step_forward(kernel, q.to(dt), k.to(dt), v.to(dt), step, out, lse)
            outf = out.transpose(0, 1).to(dt).contiguous()
            dq = torch.zeros(n, H, D, device=CUDA)
            dkv = []
            for (k, v), step in zip(kvs, calls):
                dk, dv = torch.zeros(n, hkv, D, device=CUDA), torch.zeros(n, hkv, D, device=CUDA)
                step_backward(kernel, dout.to(dt), q.to(dt), k.to(dt), v.to(dt), outf, lse, step, dq, dk, dv)
                dkv += [dk, dv]
            res[kernel] = {"out": outf, "dq": dq, "dk": torch.cat(dkv[::2]), "dv": torch.cat(dkv[1::2])}
        good, report = tensor_errors(res["aten_flash"], res["contract"])
        ok = ok and good
        for name, (err, allowed) in report.items():  # each tensor's worst rank, by error over allowance
            if name not in worst or err * worst[name][1] > worst[name][0] * allowed:
                worst[name] = (err, allowed)
    return ok, format_errors(worst)


def row_varlen_contract(out: Path) -> tuple[bool, str, str]:
    """The row: the kernel cases, the ring's steps (no window, window 100), the packed-rows path."""
    from internlm_core.utils.accelerators import probe_torch_varlen
    p = probe_torch_varlen("cuda")
    if not p.ok:
        return False, f"torch's varlen attention {p.why_not()}", ""
    results, ok = [], True
    for name, case in CASES.items():
        good, text = _kernel_case(*case)
        ok = ok and good
        results.append(f"{name}: {text}")
    for window in (None, 100):
        good, text = _ring_steps(window)
        ok = ok and good
        results.append(f"ring of 4, window {window}: {text}")
    good, text, _ = compare_attention("torch_varlen", "sdpa", CUDA)
    results.append(f"packed rows torch_varlen bf16 vs sdpa fp32: {text}")
    (out / "varlen_contract.txt").write_text("\n".join(results) + "\n")
    return ok and good, "; ".join(r.split(":")[0] + (" ok" if "OVER" not in r else " OVER") for r in results), \
        "aten flash bf16 vs the CPU contract fp32 (details in varlen_contract.txt)"
