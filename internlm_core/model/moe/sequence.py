"""The routing statistics of whole sequences under context parallel: a sum over the ranks holding their chunks.

Under context parallel (model/context) each of C ranks holds a zigzag chunk of every sequence, and its MoE layers
route that chunk only. The load-balancing loss is a product of two means over the tokens (E * sum_e P_e f_e) and
the z-loss a mean, so the chunks' own values are not parts of the sequence's: `route` (router.py) takes a
`SequenceSum` of the layer's context group and sums the statistics (probabilities and counts per expert, the
z-loss sum, the token count) over the C ranks first, one all-reduce per forward, so that every rank of the group
holds the losses of the whole sequences, as one rank without context parallel computes them.

Gradient: every rank of the group computes the same losses from the same sums and backpropagates them with the
same scale (aux_loss.py), so the gradient of a rank's own statistics is the sum over the C ranks of C equal
gradients: C times its own (no collective in backward). With FSDP's mean over the D = dp x C ranks (loss_norm.py)
the aux losses then enter the step's loss as their mean over the global batch's micro-batches, as without context
parallel.

The layer finds its group in its `context` attribute, which model/context's `set_context_parallel` sets on every
module that has one (duck-typed: `.group`, `.size`); the expert-bias loads and the step's metrics are local counts,
summed over the data x context ranks by the trainer's hooks (balance.py, the family's step metrics).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...utils import collectives


class _SumOverRanks(torch.autograd.Function):
    """all_reduce(SUM) forward; backward: the gradient times the group's size (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        ctx.size = size
        out = x.clone()
        collectives.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.size, None, None


class SequenceSum:
    """Sums a tensor over the `size` ranks of a context group (`group`), differentiably (module docstring)."""

    def __init__(self, group: Any, size: int) -> None:
        self.group, self.size = group, size

    @torch.compiler.disable  # a collective with a host-side group: eager under torch.compile
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _SumOverRanks.apply(x, self.group, self.size)


def sequence_sum(context: Optional[Any]) -> Optional[SequenceSum]:
    """The SequenceSum of a layer's context group (`ContextGroup` or None); None without context parallel."""
    if context is None or context.size <= 1:
        return None
    return SequenceSum(context.group, context.size)
