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

import struct

import torch

_SCALE = {"value": 1.0}  # the current scale, on the host
# an fp32 copy on each device a backward ran on, updated in place with it (a compiled backward reads the current
# value; a backward copying a host tensor to the device would make the host wait for the device)
_ON_DEVICE: dict[torch.device, torch.Tensor] = {}


def set_aux_loss_scale(scale: float) -> None:
    """d(loss)/d(aux_total) for the backwards to come (the grad scaler's scale / the micro-batch count)."""
    _SCALE["value"] = struct.unpack("f", struct.pack("f", float(scale)))[0]  # the fp32 value the gradient gets
    for t in _ON_DEVICE.values():
        t.fill_(_SCALE["value"])  # a fill kernel with the value as its argument: no copy from the host


def _scale_on(device: torch.device) -> torch.Tensor:
    """The fp32 scale on `device` (made there by a fill on first use, then kept up to date)."""
    t = _ON_DEVICE.get(device)
    if t is None:
        t = _ON_DEVICE[device] = torch.full((), _SCALE["value"], dtype=torch.float32, device=device)
    return t


def aux_loss_scale() -> float:
    """The current scale set by `set_aux_loss_scale`."""
    return _SCALE["value"]


class _AuxLossScaler(torch.autograd.Function):
    """Identity on `output`; the gradient of `aux` is the current scale."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad_output, _scale_on(device).to(dtype).expand(shape).clone()


@torch.compiler.disable
def attach_aux_loss(output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """`output`, carrying `aux` (a scalar with its graph) into the backward (see the module docstring).

    Kept out of torch.compile (a graph break): traced, the Function's unused `aux` input is dropped from the
    compiled graph and the aux gradient silently vanishes (seen on torch 2.13)."""
    return _AuxLossScaler.apply(output, aux)
