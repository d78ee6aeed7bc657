"""Single-process pieces of the parallel layer: layout arithmetic, the pipeline split, the TP plan's coverage,
per-token document ids (what pipeline micro-batches carry instead of cu_seqlens)."""

import pytest
import torch
import torch.nn as nn

from internlm_core.config import build_config
from internlm_core.distributed import ParallelDims
from internlm_core.errors import ConfigError
from internlm_core.model import (build_model, build_packed_meta, cu_seqlens_from_document_ids,
                                 document_ids_from_cu_seqlens)
from internlm_core.model import get_model_spec
from internlm_core.model.internlm.parallelize import block_plan, root_plan
from internlm_core.model.parallel_styles import stage_layers
from internlm_core.parallel import split_model

PLAN = get_model_spec("INTERNLM").plan


def small_cfg(num_layers=4, **model):
    m = dict(num_layers=num_layers, hidden_size=64, num_attention_heads=4, vocab_size=96, multiple_of=16,
             dtype="torch.float32")
    m.update(model)
    return build_config({"model_type": "INTERNLM", "model": m, "data": {"seq_len": 32, "micro_bsz": 2}})


@pytest.mark.parametrize("world,tp,pp,zero1,dp,shard,replicate", [
    (8, 2, 2, -1, 2, 2, 1),   # zero over all of dp
    (8, 1, 1, 1, 8, 1, 8),    # zero1=1: no sharding, 8 replicas
    (8, 1, 1, 4, 8, 4, 2),    # zero1=4: shard in groups of 4, replicate across 2 (HSDP)
    (16, 4, 2, 0, 2, 2, 1),   # zero1<=0 like -1
    (1, 1, 1, -1, 1, 1, 1),
])
def test_parallel_dims(world, tp, pp, zero1, dp, shard, replicate):
    d = ParallelDims(world_size=world, tp=tp, pp=pp, zero1=zero1)
    assert (d.dp, d.dp_shard, d.dp_replicate) == (dp, shard, replicate)
    assert (d.dp_rank, d.tp_rank, d.pp_rank) == (0, 0, 0) and d.group("dp") is None  # no mesh without a group


def test_parallel_dims_rejects_bad_layouts():
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by parallel.tensor \* parallel.pipeline \(4 \* 1\)"):
        ParallelDims(world_size=6, tp=4)
    with pytest.raises(ConfigError, match=r"parallel.zero1 \(3\) must divide the data-parallel size \(4\)"):
        ParallelDims(world_size=8, tp=2, zero1=3)


def test_stage_layers_and_errors():
    assert stage_layers(8, 4, 0) == ["0", "1"] and stage_layers(8, 4, 3) == ["6", "7"]
    with pytest.raises(ConfigError, match=r"model.num_layers \(6\) must be divisible by parallel.pipeline \* "
                                          r"model.num_chunks \(4\)"):
        stage_layers(6, 4, 0)


def test_split_keeps_parameter_names_and_shares_modules():
    torch.manual_seed(0)
    full = build_model(small_cfg(num_layers=8))
    names = dict(full.named_parameters())
    # rank 1 of pipeline 2 with 2 chunks: virtual stages 1 and 3 of 4 (layers 2,3 and 6,7; output on 3)
    model, chunks, stages = split_model(build_model(small_cfg(num_layers=8)), PLAN, 1, 2, 2)
    assert stages == [1, 3]
    assert list(model.layers.keys()) == ["2", "3", "6", "7"]
    assert model.tok_embeddings is None and model.output is not None
    kept = dict(model.named_parameters())
    assert set(kept) == {n for n in names if n.startswith(("layers.2.", "layers.3.", "layers.6.", "layers.7.",
                                                            "norm.", "output."))}
    assert list(chunks[0].layers.keys()) == ["2", "3"] and chunks[0].output is None
    assert list(chunks[1].layers.keys()) == ["6", "7"] and chunks[1].output is model.output
    assert chunks[1].layers["6"] is model.layers["6"]  # a view: optimizer and checkpoint see the same tensors
    # rank 0 without chunks: the pruned model is the stage
    model0, chunks0, stages0 = split_model(build_model(small_cfg(num_layers=8)), PLAN, 0, 2, 1)
    assert chunks0 == [model0] and stages0 == [0] and list(model0.layers.keys()) == ["0", "1", "2", "3"]
    assert model0.norm is None and model0.output is None and model0.tok_embeddings is not None


def test_chunks_compute_the_full_model():
    """Running the chunks of all ranks in stage order equals the unsplit model."""
    torch.manual_seed(0)
    ref = build_model(small_cfg(num_layers=4)).eval()
    state = ref.state_dict()
    ids = torch.randint(0, 96, (2, 32))
    pos = torch.arange(32).expand(2, 32)
    doc = torch.zeros(2, 32, dtype=torch.long)
    parts = {}
    for rank in range(2):
        m = build_model(small_cfg(num_layers=4))
        m.load_state_dict(state)
        _, chunks, stages = split_model(m, PLAN, rank, 2, 2)
        parts.update(zip(stages, chunks))
    with torch.no_grad():
        h = ids
        for s in range(4):
            h = parts[s](h, position_ids=pos, document_ids=doc)
        assert torch.allclose(h, ref(ids), atol=1e-6)
        with pytest.raises(ValueError, match="position_ids are required"):
            parts[1](torch.zeros(2, 32, 64))


def test_tied_embeddings_rejected_under_pipeline():
    with pytest.raises(ConfigError, match="model.tie_word_embeddings: not supported with parallel.pipeline > 1"):
        split_model(build_model(small_cfg(tie_word_embeddings=True)), PLAN, 0, 2, 1)


def test_tensor_parallel_plan_covers_every_weight():
    """A new Linear or norm in a block must get a plan entry; otherwise it would silently stay unsharded
    (or, for a norm, a plain tensor next to DTensors)."""
    model = build_model(small_cfg())
    block = model.layers["0"]
    for sp in (False, True):
        plan = block_plan(sp)
        needing = {n for n, m in block.named_modules() if isinstance(m, (nn.Linear, nn.RMSNorm))}
        assert needing <= set(plan), needing - set(plan)
        assert set(root_plan(model, sp, True)) == {"tok_embeddings", "norm", "output"}


def test_document_ids_round_trip_and_same_attention():
    cu = torch.tensor([0, 5, 16, 32, 35, 55, 64], dtype=torch.int32)  # rows of 32: [5, 11, 16], [3, 20, 9]
    doc = document_ids_from_cu_seqlens(cu, 2, 32)
    assert doc.shape == (2, 32) and doc[0, :5].eq(0).all() and doc[0, 5].item() == 1 and doc[1, 0].item() == 3
    assert cu_seqlens_from_document_ids(doc).tolist() == cu.tolist()
    # the same id in two rows are still two documents (row starts are boundaries)
    assert cu_seqlens_from_document_ids(torch.zeros(2, 32, dtype=torch.long)).tolist() == [0, 32, 64]
    a = build_packed_meta(cu, 2, 32, "cpu_blocked", torch.device("cpu"))
    b = build_packed_meta(None, 2, 32, "cpu_blocked", torch.device("cpu"), document_ids=doc)
    assert len(a.block_masks) == len(b.block_masks) == 1 and torch.equal(a.block_masks[0], b.block_masks[0])
    with pytest.raises(ValueError, match=r"document_ids must have shape \[2, 32\]"):
        build_packed_meta(None, 2, 32, "cpu_blocked", torch.device("cpu"), document_ids=doc.view(1, 64))
    torch.manual_seed(0)
    model = build_model(small_cfg(num_layers=2)).eval()
    ids = torch.randint(0, 96, (2, 32))
    pos = torch.cat([torch.arange(n) for n in (5, 11, 16, 3, 20, 9)]).view(2, 32)
    with torch.no_grad():
        assert torch.equal(model(ids, pos, cu), model(ids, pos, document_ids=doc))
