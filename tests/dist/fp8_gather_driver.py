"""Two-rank driver (gloo): FSDP2 units made of float8 weights only (two Float8Linear, each its own unit, no norm
beside them), so FSDP's all-gather buffer is float8 itself (a unit with mixed dtypes is gathered as uint8 by FSDP).
Plain gloo refuses it ("Invalid scalar type"); through parallel/float8.send_float8_as_bytes the float8 all-gather
gives bitwise the outputs and gradients of FSDP's fp32 all-gather (torchao casts the whole weight with one scale
either way)."""

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
import torchao.float8 as ao
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from internlm_core.parallel.float8 import send_float8_as_bytes


def build(gather: bool, mesh) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False))
    config = dataclasses.replace(ao.Float8LinearConfig.from_recipe_name("tensorwise"),
                                 enable_fsdp_float8_all_gather=gather)
    ao.convert_to_float8_training(model, config=config)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = model(x)
    out.float().pow(2).mean().backward()
    return out.detach(), [p.grad.full_tensor() for p in model.parameters()]


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank))
    ref_out, ref_grads = step(build(False, mesh), x)
    plain = build(True, mesh)
    try:
        step(plain, x)
        print(f"rank {rank}: float8 all-gather ran on plain gloo")
    except RuntimeError as e:
        print(f"rank {rank}: plain gloo refused: {str(e).splitlines()[0][:80]}")
    model = build(True, mesh)
    units = send_float8_as_bytes(model)
    out, grads = step(model, x)
    assert units == 3, units
    assert torch.equal(out, ref_out), (out - ref_out).abs().max()
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r), (g - r).abs().max()
    print(f"rank {rank}: bytes ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
