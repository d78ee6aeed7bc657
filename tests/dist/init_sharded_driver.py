"""Two-rank driver (gloo): parameters of several shapes (even and uneven splits), sharded as DTensors with Shard(0)
and Shard(1), initialized by model.init_parameters on each rank; gathered, they must equal the unsharded init
bitwise, and each rank must have drawn its own elements only (its shard's global indices, per dimension)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Shard, distribute_tensor  # noqa: E402

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from internlm_core.model.init import init_parameters, shard_indices  # noqa: E402

SHAPES = {"even": (8, 6), "uneven": (7, 5), "tall": (33, 3), "cube": (5, 4, 6)}


def fill(name, values, generator):
    values.normal_(0.0, 0.02, generator=generator)


def module(shapes, mesh=None, placement=None):
    m = torch.nn.Module()
    for name, shape in shapes.items():
        t = torch.empty(shape)
        if mesh is not None:
            t = distribute_tensor(t, mesh, [placement])
        m.register_parameter(name, torch.nn.Parameter(t))
    return m


class LargestTensor(TorchDispatchMode):
    """The most elements any tensor made while it is active had."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def never_holds_the_whole(mesh) -> None:
    """A sharded parameter is drawn without any tensor as large as the whole one (the earlier init drew every full
    parameter on every rank and copied its shard out)."""
    big = module({"big": (256, 2048)}, mesh, Shard(0))
    with LargestTensor() as seen:
        init_parameters(big, 1234, fill)
    assert 0 < seen.numel < 256 * 2048, seen.numel


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    whole = module(SHAPES)
    init_parameters(whole, 1234, fill)
    for placement in (Shard(0), Shard(1)):
        sharded = module(SHAPES, mesh, placement)
        init_parameters(sharded, 1234, fill)
        for name, p in sharded.named_parameters():
            expected = getattr(whole, name)
            assert torch.equal(p.full_tensor(), expected), f"{placement} {name}: gathered differs from unsharded"
            # this rank's shard is the product of its per-dimension indices, as DTensor laid it out
            index = shard_indices(p)
            ids = distribute_tensor(torch.arange(expected.numel()).view(expected.shape), mesh, [placement])
            mine = expected.flatten()[ids.to_local().flatten()].view(p.to_local().shape)
            assert torch.equal(p.to_local(), mine), f"{placement} {name}: not this rank's elements"
            assert [len(i) for i in index] == list(p.to_local().shape), (name, index)
    never_holds_the_whole(mesh)
    print(f"rank {rank}: ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
