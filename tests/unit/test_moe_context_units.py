"""MoE under context parallel, one process: the router's losses over a sum of the chunks' statistics are the
whole sequence's, and the mesh gives the experts' FSDP the data ranks their dimension leaves x the context ranks
(tests/dist/test_moe_context.py trains it on real ranks)."""

import torch

from internlm_core.distributed.parallel_dims import ParallelDims
from internlm_core.model.moe import MoEArgs
from internlm_core.model.moe.router import route


def _sums(tokens, args):
    """The [probabilities per expert, counts per expert, z-loss sum, tokens] a rank routing `tokens` contributes."""
    captured = {}

    def grab(x):
        captured["x"] = x.detach()
        return x
    route(tokens, args, training=True, over=grab)
    return captured["x"]


def test_the_chunks_losses_over_the_sequence_sum_are_the_whole_sequences():
    torch.manual_seed(0)
    logits = torch.randn(24, 6)
    for args in (MoEArgs(num_experts=6, top_k=2, ffn_width=8, moe_type="Dropless"),
                 MoEArgs(num_experts=6, top_k=2, ffn_width=8, moe_type="GShard", drop_tokens=False)):
        whole = route(logits, args, training=True)
        chunks = (logits[:8], logits[8:])  # two ranks' tokens
        for mine, other in ((chunks[0], chunks[1]), (chunks[1], chunks[0])):
            sent = []

            def over(x):  # what the all-reduce returns: this rank's sums plus the other rank's
                sent.append(tuple(x.shape))
                return x + _sums(other, args)
            r = route(mine, args, training=True, over=over)
            assert sent == [(2 * 6 + 2,)]  # one sum per forward
            assert torch.allclose(r.l_aux, whole.l_aux, atol=1e-6) and torch.allclose(r.l_z, whole.l_z, atol=1e-6)
            alone = route(mine, args, training=True)
            assert not torch.allclose(alone.l_aux, whole.l_aux, atol=1e-4)  # a chunk's own loss is not a part


def test_the_experts_fsdp_mesh_is_the_rest_of_the_data_ranks_times_context():
    dims = ParallelDims(world_size=16, cp=2, extra=(("ep", 2),))
    assert [(a.name, a.size) for a in dims.axes] == [("pp", 1), ("dp_replicate", 1), ("dp_shard_rest", 4),
                                                      ("cp", 2), ("ep", 2), ("tp", 1)]
    flat = dims.flattened()
    # one block of the mesh ahead of "ep": DTensor slices (dp_shard_rest_cp, ep) in order
    assert flat["dp_shard_rest_cp"] == ("dp_shard_rest", "cp") and dims.flat_size("dp_shard_rest_cp") == 8
    assert flat["dp_shard_cp"] == ("dp_shard_rest", "cp", "ep") and flat["dp"] == ("dp_replicate", "dp_shard_rest",
                                                                                   "ep")
    assert "dp_shard_rest_cp" not in ParallelDims(world_size=16, cp=2).flattened()  # no family dimension
    # without context parallel the family's layout keeps its rank order
    assert [a.name for a in ParallelDims(world_size=8, extra=(("ep", 2),)).axes] == \
        ["pp", "dp_replicate", "dp_shard_rest", "cp", "ep", "tp"]
