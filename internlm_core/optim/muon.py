"""Muon for the hidden matrices, AdamW for the rest, in one optimizer (optimizer.name = "muon"), as Moonlight and
Kimi-K2 train: each whole matrix orthogonalized, also under FSDP2, tensor parallel and expert parallel.

Which parameters (`model.roles.hidden_matrices`): Muon takes the >= 2-D weights inside the transformer blocks (the
attention and MLP matrices; a 3-D MoE expert weight [E, rows, columns] as E matrices of its own); AdamW takes the
rest: the embeddings and the output head (outside the blocks), norms and biases (1-D), and the MoE routers.

Muon's step for a matrix W with gradient G (torch.optim.Muon's, Moonlight's scaling):
    B <- lerp(B, G, 1 - momentum);  U <- lerp(G, B, momentum) (Nesterov) or B
    O <- NS5(U): U / ||U||_F, then `ns_steps` quintic Newton-Schulz iterations X <- aX + (bA + cA^2) X, A = XX^T,
         (a, b, c) = (3.4445, -4.7750, 2.0315), on the wide orientation, in `ns_dtype`
    W <- W (1 - lr wd) - lr * rms_scale * sqrt(max(rows, columns)) * O
rms_scale 0.2 gives O's update the RMS of AdamW's (Moonlight, "Muon is Scalable for LLM Training"), so adam.lr and
adam.weight_decay carry over. The AdamW part is torch's single-tensor AdamW (decoupled weight decay, the `adam` keys).

Distributed: Newton-Schulz of a shard is not the shard of Newton-Schulz (torch.optim.Muon on FSDP2 shards is wrong by
~20% in one step). A DTensor whose matrices are cut (a Shard placement on one of its last two dims: FSDP2's Shard(0)
of a 2-D weight, tensor parallel's Shard(0) / Shard(1)) is gathered whole (`DTensor.full_tensor`), orthogonalized
by every rank of its mesh alike, and each rank keeps its own part (`distribute_tensor(..., src_data_rank=None)`: a
local slice, no communication). A DTensor cut only along its first dim of a 3-D weight (expert parallel's and FSDP2's
Shard(0) over experts) holds whole experts: each rank orthogonalizes its own, without communication. The momentum
buffers are DTensors placed as their parameters, so checkpoints (DCP) save and reshard them as AdamW's moments.

qk-clip (MuonClip, `optimizer.muon_qk_clip` = tau): after each step, `qk_clip` scales the W_q / W_k rows of every head
whose largest pre-softmax logit in the step's forwards (model/qk_clip.py) exceeded tau, by sqrt(tau / max) each.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Shard, _StridedShard

from ..utils.collectives import all_reduce

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def newton_schulz(g: torch.Tensor, coefficients: Sequence[float] = NS_COEFFICIENTS, steps: int = 5,
                  eps: float = 1e-7, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The orthogonalization of each matrix of `g` (2-D, or a batch [E, rows, columns] of matrices), in `dtype`:
    torch.optim.Muon's iteration (the same ops for a 2-D input, so the same bits)."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    if x.dim() == 2:
        x = x.div(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        x = x.div(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def matrices_are_cut(t: torch.Tensor) -> bool:
    """A DTensor with a Shard placement (or FSDP2's _StridedShard, under tensor parallel) on one of its last two dims:
    its local part holds pieces of matrices."""
    if not isinstance(t, DTensor):
        return False
    return any(isinstance(pl, (Shard, _StridedShard)) and pl.dim % t.dim() >= t.dim() - 2 for pl in t.placements)


def orthogonalize(u: torch.Tensor, **ns) -> torch.Tensor:
    """newton_schulz of each whole matrix of `u`, placed as `u` (a DTensor's shard: gathered, iterated, sliced)."""
    if not isinstance(u, DTensor):
        return newton_schulz(u, **ns)
    if not matrices_are_cut(u):  # whole matrices here (experts sharded by expert, or replicated): local work
        local = newton_schulz(u.to_local(), **ns)
        return DTensor.from_local(local, u.device_mesh, u.placements, run_check=False, shape=u.shape,
                                  stride=u.stride())
    full = newton_schulz(u.full_tensor(), **ns)
    return distribute_tensor(full, u.device_mesh, u.placements, src_data_rank=None)


def update_scale(shape: Sequence[int], rms_scale: float) -> float:
    """Moonlight's factor on lr: rms_scale * sqrt(max(rows, columns)) of the (global) matrix shape."""
    return rms_scale * math.sqrt(max(shape[-2], shape[-1]))


def _reduce_max(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`t` maximized over every rank of `like`'s mesh (a DTensor parameter: FSDP's data ranks see other rows)."""
    if isinstance(like, DTensor):
        for dim in range(like.device_mesh.ndim):
            all_reduce(t, op=dist.ReduceOp.MAX, group=like.device_mesh.get_group(dim))
    return t


def _scale_rows(linear: torch.nn.Module, rows: torch.Tensor) -> None:
    """Multiply each output row of `linear` (its weight, and its bias) by `rows` [out] (a DTensor's own part)."""
    w = linear.weight
    if isinstance(w, DTensor):
        w.mul_(distribute_tensor(rows[:, None].to(w.dtype), w.device_mesh, w.placements, src_data_rank=None))
    else:
        w.mul_(rows[:, None].to(w.dtype))
    if linear.bias is not None:
        b = linear.bias
        b.mul_(distribute_tensor(rows.to(b.dtype), b.device_mesh, b.placements, src_data_rank=None)
               if isinstance(b, DTensor) else rows.to(b.dtype))


def qk_clip(heads: Sequence, tau: float) -> int:
    """MuonClip (Kimi-K2), after an optimizer step: each head whose largest logit of the step (model/qk_clip.py's
    record, maximized over the data ranks) exceeded `tau` has its W_q rows scaled by sqrt(tau / max) and its kv head's
    W_k rows by the square root of the smallest such factor of the heads sharing it (grouped-query attention: a
    shared key must not lift another head's logit). Biases are scaled with their rows. Clears the records; returns
    the number of heads clipped."""
    clipped = 0
    with torch.no_grad():
        for h in heads:
            if h.record.value is None:
                continue
            top = _reduce_max(h.record.value.float().clone(), h.wq.weight)
            h.record.value = None
            gamma = torch.where(top > tau, tau / top.clamp(min=tau), torch.ones_like(top))
            clipped += int((gamma < 1).sum())
            if bool((gamma < 1).any()):
                shared = gamma.view(h.kv_heads, h.heads // h.kv_heads).amin(dim=1)
                _scale_rows(h.wq, gamma.sqrt().repeat_interleave(h.head_dim))
                _scale_rows(h.wk, shared.sqrt().repeat_interleave(h.head_dim))
    return clipped


class Muon(torch.optim.Optimizer):
    """Muon for the groups with `use_muon` True, AdamW for the others (module docstring: the step, the split and
    the distributed rule). Every group carries lr, weight_decay and AdamW's betas/eps (the beta2 schedule and the
    trainer's metrics read `betas`); the Muon keys are defaults of all groups."""

    def __init__(self, params: Iterable[dict], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: Sequence[float] = NS_COEFFICIENTS, ns_steps: int = 5, ns_dtype: str = "bfloat16",
                 rms_scale: float = 0.2, ns_eps: float = 1e-7, clip: Optional[Callable[[], int]] = None):
        if ns_dtype not in _DTYPES:
            raise ValueError(f"ns_dtype: expected one of {', '.join(_DTYPES)}, got {ns_dtype!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, use_muon=False,
                        momentum=momentum, nesterov=nesterov, ns_coefficients=tuple(ns_coefficients),
                        ns_steps=ns_steps, ns_dtype=ns_dtype, rms_scale=rms_scale, ns_eps=ns_eps)
        super().__init__(params, defaults)
        self.clip, self.last_clipped = clip, 0  # optimizer.muon_qk_clip: qk_clip over the model's heads, each step
        for group in self.param_groups:
            if group["use_muon"]:
                flat = [p for p in group["params"] if p.dim() < 2]
                if flat:
                    raise ValueError(f"Muon: group {group.get('name', '?')!r} holds a {flat[0].dim()}-D parameter;"
                                     " Muon updates matrices (2-D, or 3-D as one matrix per expert)")

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch.optim.Optimizer's signature
        """One step of every group (Muon or AdamW); `closure` re-evaluates the loss, as in torch's optimizers."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group(group)
            else:
                self._adamw_group(group)
        if self.clip is not None:
            self.last_clipped = self.clip()
        return loss

    def _muon_group(self, group: dict) -> None:
        lr, wd, mom = group["lr"], group["weight_decay"], group["momentum"]
        ns = dict(coefficients=group["ns_coefficients"], steps=group["ns_steps"], eps=group["ns_eps"],
                  dtype=_DTYPES[group["ns_dtype"]])
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(g, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(g, 1 - mom)
            u = g.lerp(buf, mom) if group["nesterov"] else buf
            o = orthogonalize(u, **ns)
            p.mul_(1 - lr * wd)
            p.add_(o, alpha=-lr * update_scale(p.shape, group["rms_scale"]))

    def _adamw_group(self, group: dict) -> None:
        """torch's single-tensor AdamW (torch.optim.adamw with foreach=False, fused=False), step by step."""
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")  # a host counter, as torch's AdamW keeps it
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            step = state["step"].item()
            p.mul_(1 - lr * wd)
            state["exp_avg"].lerp_(g, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            bias_correction2_sqrt = (1 - beta2**step) ** 0.5
            denom = (state["exp_avg_sq"].sqrt() / bias_correction2_sqrt).add_(eps)
            p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**step))
