"""Two-rank driver (gloo): VocabParallelEmbedding against an unsharded nn.Embedding, for both stream layouts."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

from internlm_core.model.parallel_styles import VocabParallelEmbedding


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    for layout in (Replicate(), Shard(1)):  # without / with sequence parallel
        torch.manual_seed(0)
        ref = torch.nn.Embedding(1000, 16)
        emb = torch.nn.Embedding(1000, 16)
        emb.load_state_dict(ref.state_dict())
        parallelize_module(emb, mesh, VocabParallelEmbedding(layout))
        ids = torch.randint(0, 1000, (2, 8))
        ids[0, :2] = torch.tensor([499, 500])  # both sides of the rows' boundary
        weight = torch.randn(2, 8, 16)
        out, expected = emb(ids), ref(ids)
        sl = (slice(None), slice(rank * 4, rank * 4 + 4)) if isinstance(layout, Shard) else (slice(None),)
        assert torch.equal(out, expected[sl]), f"{layout}: forward differs"
        (out * weight[sl]).sum().backward()
        (expected * weight).sum().backward()
        grad = emb.weight.grad
        # each rank computed and holds its own 500 rows' gradient only
        assert grad.placements == (Shard(0),) and tuple(grad.to_local().shape) == (500, 16), grad.placements
        assert torch.allclose(grad.full_tensor(), ref.weight.grad), f"{layout}: gradient differs"
    print(f"rank {rank}: ok")


if __name__ == "__main__":
    main()
