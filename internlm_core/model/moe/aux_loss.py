"""The auxiliary losses reach the gradient without leaving the layer (Megatron-core's MoEAuxLossAutoScaler).

The model's contract stays `model(ids, pos, cu_seqlens) -> logits`: under pipeline parallel only the last stage
sees the loss, so an MoE layer cannot hand its aux loss to the trainer. Instead the layer's output passes through
`attach_aux_loss(output, aux_total)`: the identity in forward; in backward the output's gradient passes unchanged
and aux_total receives d(loss)/d(aux_total) = the current scale, as if `scale * aux_total` had been added to the
loss the trainer backpropagates. The trainer sets the scale before each backward with
`set_aux_loss_scale(grad_scaler_scale / micro_num)` (InternEvo divides moe_loss by the micro-batch count as it does
the loss); default 1.0.
"""

from __future__ import annotations

import torch

_SCALE = torch.ones(())  # a tensor updated in place: a compiled backward reads its current value


def set_aux_loss_scale(scale: float) -> None:
    """d(loss)/d(aux_total) for the backwards to come (the grad scaler's scale / the micro-batch count)."""
    _SCALE.fill_(float(scale))


def aux_loss_scale() -> float:
    """The current scale set by `set_aux_loss_scale`."""
    return float(_SCALE)


class _AuxLossScaler(torch.autograd.Function):
    """Identity on `output`; the gradient of `aux` is the current scale."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad_output, _SCALE.to(device=device, dtype=dtype).expand(shape).clone()


@torch.compiler.disable
def attach_aux_loss(output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """`output`, carrying `aux` (a scalar with its graph) into the backward (see the module docstring).

    Kept out of torch.compile (a graph break): traced, the Function's unused `aux` input is dropped from the
    compiled graph and the aux gradient silently vanishes (seen on torch 2.13)."""
    return _AuxLossScaler.apply(output, aux)
