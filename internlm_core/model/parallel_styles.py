"""Building blocks for the families' parallel plans: a DTensor style torch lacks, and the pipeline's even split."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from ..errors import ConfigError


class ReplicateParallel(ParallelStyle):
    """Parameters replicated over the mesh as DTensors; inputs and outputs stay plain (local) tensors.

    For modules that every rank computes in full on the same input (the norms without sequence parallel).
    The gradient of a replicated weight is computed from identical inputs on every rank, so it is
    identical (Replicate) without communication.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(mod, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
                         if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

        def to_local(mod, outputs, mesh):
            return outputs.to_local() if isinstance(outputs, DTensor) else outputs

        return distribute_module(module, device_mesh, None, input_fn=to_dtensor, output_fn=to_local)


def stage_layers(num_layers: int, num_stages: int, stage: int) -> list[str]:
    """Names ("0", "1", ...) of the blocks of one virtual pipeline stage: an equal, contiguous run each."""
    if num_layers % num_stages:
        raise ConfigError(f"model.num_layers ({num_layers}) must be divisible by parallel.pipeline * model.num_chunks "
                          f"({num_stages}) to split the layers into pipeline stages")
    per = num_layers // num_stages
    return [str(i) for i in range(stage * per, (stage + 1) * per)]
