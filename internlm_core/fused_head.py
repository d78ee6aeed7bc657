"""The output head and the cross entropy fused, chunk by chunk over tokens (issue 38 item 3; Liger's and
cut-cross-entropy's design): the [tokens, vocab] logits never exist whole.

Forward, per chunk of rows: logits = hidden @ weight^T (the chunk's only), their max, sum of exponentials, the
label's logit and the sum over the vocabulary (label smoothing), reduced over the tensor-parallel group when the
weight holds a shard of the vocabulary (`group`, `vocab_start`); then each token's log-sum-exp (kept: 4 bytes a
token), loss and argmax. Backward goes chunk by chunk over the vocabulary instead: it recomputes the logits of a
chunk of vocabulary rows for every token from the kept hidden states and weight, turns them into the logits'
gradient, (1 + 2 z lse) softmax - (1 - e) one_hot - e / V, times the token's incoming gradient, and from it writes
those rows' weight gradient whole (one matmul over all tokens, in the weight's compute dtype: no fp32 accumulator of
the weight's size) and adds to the hidden states' gradient (fp32, tokens x hidden; summed over the group).

Per-token loss: (1 - e) (lse - x_label) + e (lse - mean_v x_v) + z lse^2 (e: label smoothing; z: z-loss, PaLM's),
0 where the label is -100. The metrics get the plain cross entropy (lse - x_label) and the argmax.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from .errors import ConfigError
from .utils import collectives

# bytes of the fp32 logits of one chunk: on a CPU they stay in the caches, on a GPU a few large matmuls
CHUNK_BYTES = {"cpu": 8 << 20, "cuda": 512 << 20}


def chunk_rows(vocab: int, device: torch.device) -> int:
    """Rows of one chunk for a (local) vocabulary of `vocab`."""
    return max(1, CHUNK_BYTES.get(device.type, CHUNK_BYTES["cuda"]) // (4 * vocab))


def chunk_cols(tokens: int, device: torch.device) -> int:
    """Vocabulary rows of one backward chunk over `tokens` tokens (the same bytes as a forward chunk)."""
    return max(1, CHUNK_BYTES.get(device.type, CHUNK_BYTES["cuda"]) // (4 * tokens))


def _all_reduce(t: torch.Tensor, group: Optional[dist.ProcessGroup], op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        collectives.all_reduce(t, op=op, group=group)
    return t


def _chunk_forward(x: torch.Tensor, w: torch.Tensor, label: torch.Tensor, start: int, vocab: int,
                   group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse, label logit, sum of logits, argmax) of one chunk of rows, over the whole (sharded) vocabulary."""
    z = (x @ w.t()).float()
    local_max, local_arg = z.max(dim=-1)
    m = _all_reduce(local_max.clone(), group, dist.ReduceOp.MAX)
    own = (label >= start) & (label < start + w.shape[0])
    picked = torch.where(own, z.gather(1, (label - start).clamp(0, w.shape[0] - 1).unsqueeze(1)).squeeze(1), 0.0)
    stats = _all_reduce(torch.stack([(z - m.unsqueeze(1)).exp_().sum(dim=-1), picked, z.sum(dim=-1)]), group)
    # the first maximum over the whole vocabulary: the lowest global index among the ranks holding it
    arg = torch.where(local_max == m, local_arg + start, vocab)
    arg = _all_reduce(arg, group, dist.ReduceOp.MIN)
    return stats[0].log() + m, stats[1], stats[2], arg


class FusedHeadCrossEntropy(torch.autograd.Function):
    """hidden [N, h], weight [V_local, h] (this rank's rows of the vocabulary, from `vocab_start`), labels [N] ->
    (per-token loss fp32 [N], per-token cross entropy fp32 [N] (no gradient), argmax [N])."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, label_smoothing: float,
                z_loss: float, group: Optional[dist.ProcessGroup], vocab_start: int, vocab: int):  # noqa: D102
        n = hidden.shape[0]
        dev = hidden.device
        lse = torch.empty(n, dtype=torch.float32, device=dev)
        picked, total = torch.empty_like(lse), torch.empty_like(lse)
        argmax = torch.empty(n, dtype=torch.long, device=dev)
        valid = labels != -100
        w = weight.to(hidden.dtype)  # autocast's compute dtype: the hidden states'
        step = chunk_rows(weight.shape[0], dev)
        for s in range(0, n, step):
            e = min(s + step, n)
            lse[s:e], picked[s:e], total[s:e], argmax[s:e] = _chunk_forward(
                hidden[s:e], w, labels[s:e], vocab_start, vocab, group)
        ce = torch.where(valid, lse - picked, 0.0)
        loss = (1.0 - label_smoothing) * ce
        if label_smoothing:
            loss = loss + label_smoothing * torch.where(valid, lse - total / vocab, 0.0)
        if z_loss:
            loss = loss + z_loss * torch.where(valid, lse * lse, 0.0)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.options = (label_smoothing, z_loss, group, vocab_start, vocab)
        ctx.mark_non_differentiable(ce, argmax)
        return loss, ce, argmax

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_ce, _grad_argmax):  # noqa: D102
        hidden, weight, labels, lse = ctx.saved_tensors
        smoothing, z_loss, group, start, vocab = ctx.options
        valid = labels != -100
        w = weight.to(hidden.dtype)
        g = torch.where(valid, grad_loss.float(), 0.0)
        scale = g * (1.0 + 2.0 * z_loss * lse)  # the softmax's factor per token
        rows_local = weight.shape[0]
        own = valid & (labels >= start) & (labels < start + rows_local)  # the label's row is this rank's
        label_row = torch.where(own, labels - start, -1)
        hit = (g * (1.0 - smoothing)).neg_()  # the one-hot's term, at the label's row
        n = hidden.shape[0]
        acc = torch.zeros(n, hidden.shape[1], dtype=torch.float32, device=hidden.device) \
            if ctx.needs_input_grad[0] else None
        grad_weight = torch.empty(weight.shape, dtype=w.dtype, device=w.device) if ctx.needs_input_grad[1] else None
        step = chunk_cols(n, hidden.device)
        for v0 in range(0, rows_local, step):
            v1 = min(v0 + step, rows_local)
            wc = w[v0:v1]
            dz = (hidden @ wc.t()).float().sub_(lse.unsqueeze(1)).exp_().mul_(scale.unsqueeze(1))
            if smoothing:
                dz.sub_((g * smoothing / vocab).unsqueeze(1))
            inside = (label_row >= v0) & (label_row < v1)  # a scatter, not an index of the hits: no host sync
            dz.scatter_add_(1, (label_row - v0).clamp_(0, v1 - v0 - 1).unsqueeze(1),
                            torch.where(inside, hit, 0.0).unsqueeze(1))
            dz = dz.to(hidden.dtype)
            if acc is not None:
                acc += dz @ wc
            if grad_weight is not None:  # these vocabulary rows' gradient, whole: one matmul over every token
                grad_weight[v0:v1].addmm_(dz.t(), hidden, beta=0)  # beta 0: the empty buffer is not read
        grad_hidden = None
        if acc is not None:
            grad_hidden = _all_reduce(acc.to(hidden.dtype), group)  # every rank's vocabulary rows contribute
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def fused_head_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             label_smoothing: float = 0.0, z_loss: float = 0.0,
                             group: Optional[dist.ProcessGroup] = None, vocab_start: int = 0,
                             vocab: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss [N] with its gradient, per-token cross entropy [N], argmax [N]) of hidden [..., h] through the
    head `weight` [V_local, h] against labels [...] (-100 ignored). Under tensor parallel `weight` is this rank's
    rows of the vocabulary (`vocab_start` on, `vocab` in all) and `group` the tensor-parallel group."""
    h = hidden.shape[-1]
    vocab = weight.shape[0] if vocab is None else vocab
    return FusedHeadCrossEntropy.apply(hidden.reshape(-1, h), weight, labels.reshape(-1), float(label_smoothing),
                                       float(z_loss), group, vocab_start, vocab)


class FusedHead:
    """The model's output layer (`model.output`, its weight [V, h] or a tensor-parallel DTensor of its rows),
    applied by the loss instead of the model: `deferred(model)` runs the model up to the head's input.
    sequence_parallel: under tensor + sequence parallel the head's input arrives as this rank's slice of the
    sequence (dim 1, the final norm's local output): it is all-gathered over the weight's mesh (a DTensor
    redistribution, whose backward hands each rank its slice of the gradient, which the fused backward already
    summed over the vocabulary shards), as the unfused output layer's ColwiseParallel does."""

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """Whether `model` has the output layer the fused head applies: `output`, a linear layer without bias."""
        return isinstance(getattr(model, "output", None), nn.Linear) and model.output.bias is None

    def __init__(self, model: nn.Module, sequence_parallel: bool = False, holders: tuple = ()):
        if not self.supports(model):
            raise ConfigError(f"model.fused_head_loss: expected the model's output layer `output` to be a linear "
                              f"layer without bias, got {type(getattr(model, 'output', None)).__name__}")
        self.model = model
        self.output = model.output
        self.sequence_parallel = sequence_parallel
        # the modules whose forward applies the output layer: the model, and under pipeline parallel the stage
        # chunk that holds it (a module of its own sharing the layer, when a rank runs several stages)
        self.holders = [model] + [m for m in holders if m is not model and getattr(m, "output", None) is self.output]

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """The model's forward returns the output layer's input (the final norm's output) instead of the logits."""
        for m in self.holders:
            m._modules["output"] = None
        try:
            yield
        finally:
            for m in self.holders:
                m._modules["output"] = self.output

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0,
                 z_loss: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`fused_head_cross_entropy` with the output layer's weight (this rank's rows under tensor parallel)."""
        weight = self.output.weight
        group, start, vocab = None, 0, weight.shape[0]
        if isinstance(weight, DTensor):
            if weight.device_mesh.ndim != 1 or weight.placements[0] != Shard(0):
                raise ValueError(f"fused head: expected the output weight sharded by rows over one mesh "
                                 f"dimension, got {weight.placements}")
            mesh = weight.device_mesh
            group = mesh.get_group()
            local = weight.to_local()
            start, weight = mesh.get_local_rank() * local.shape[0], local
            if self.sequence_parallel and not isinstance(hidden, DTensor):  # this rank's slice of the sequence
                hidden = DTensor.from_local(hidden, mesh, (Shard(1),), run_check=False)
        if isinstance(hidden, DTensor):
            hidden = hidden.full_tensor()
        return fused_head_cross_entropy(hidden, weight, labels, label_smoothing, z_loss, group, start, vocab)
