"""The families' counts (ModelSpec.counts) against their modules, parameter shapes from the spec, and a family that
adds its own terms (expert weights over an "ep" mesh dimension, all-to-all bytes) without the estimator changing."""

import dataclasses

import pytest

from internlm_core.config import load_config
from internlm_core.errors import ConfigError
from internlm_core.estimate import estimate
from internlm_core.estimate.figures import Layout
from internlm_core.estimate.terms import fsdp_share, per_device
from internlm_core.model import (ModelSpec, analytic_parameter_count, build_model, count_parameters, get_model_spec,
                                 model_args_from_config, register_model, unregister_model)
from internlm_core.model.counts import Linear, Parameters, Term
from internlm_core.model.spec import MeshDim

FAMILIES = [("INTERNLM", []), ("INTERNLM2", ["model.num_kv_attention_heads=2"]),
            ("LLAMA", ["model.num_kv_attention_heads=1", "model.tie_word_embeddings=True"])]


@pytest.mark.parametrize("model_type,extra", FAMILIES, ids=[f for f, _ in FAMILIES])
def test_counts_are_the_modules_parameters(model_type, extra):
    cfg = load_config("configs/tiny.py", [f"model_type={model_type}", "model.num_layers=3", *extra])
    spec, args = get_model_spec(model_type), model_args_from_config(cfg)
    model = build_model(cfg, "meta")
    c = spec.counts
    block, embedding, head = c.block(args), c.embedding(args), c.head(args)
    assert block.count == sum(p.numel() for p in model.layers["0"].parameters())
    assert embedding.count == model.tok_embeddings.weight.numel()
    tied = model.output.weight is model.tok_embeddings.weight
    assert head.count == model.norm.weight.numel() + (0 if tied else model.output.weight.numel())
    total = args.num_layers * block.count + embedding.count + head.count
    assert total == count_parameters(model) == analytic_parameter_count(args)
    # every block weight a matmul multiplies is a Linear of the counts, with its shape
    shapes = {n: tuple(p.shape) for n, p in model.layers["0"].named_parameters() if p.ndim == 2}
    assert shapes == {w.name + ".weight": (w.out_features, w.in_features) for w in block.linears}


@pytest.mark.parametrize("model_type,extra", FAMILIES, ids=[f for f, _ in FAMILIES])
def test_parameter_shapes_come_from_the_spec(model_type, extra):
    cfg = load_config("configs/tiny.py", [f"model_type={model_type}", *extra])
    shapes = get_model_spec(model_type).parameter_shapes(model_args_from_config(cfg))
    sd = build_model(cfg, "meta").state_dict()
    assert list(shapes) == list(sd)  # state_dict order: layer by layer
    assert all(t.device.type == "meta" and t.shape == sd[k].shape and t.dtype == sd[k].dtype for k, t in shapes.items())


def test_terms_divide_by_their_mesh_dimensions():
    lay = Layout(world_size=16, tp=2, pp=1, dp=8, dp_shard=8, num_chunks=1, sequence_parallel=False, dims={"ep": 4})
    experts = Term("experts", 64_000, ("ep", "tp"))
    dense = Term("attention", 1_000, ("tp",))
    assert per_device([experts, dense, Term("norm", 10, ("sp",))], lay.sizes) == 8_000 + 500 + 10
    # FSDP shards the experts over the data-parallel ranks "ep" leaves (8 / 4), the rest over all 8
    assert fsdp_share([experts], lay) == 64_000 / 8 / 2 and fsdp_share([dense], lay) == 1_000 / 2 / 8
    with pytest.raises(ConfigError, match="mesh dimension 'xp', which neither the generic layout"):
        per_device([Term("future dimension", 1, ("xp",))], lay.sizes)


def test_a_family_adds_its_own_terms_without_the_estimator_changing():
    """A toy expert-parallel family: LLAMA plus 8 experts of w1/w2/w3 per block split over "ep" and tensor
    parallel, and an all-to-all of the hidden states (there and back, forward and backward) per block."""
    base = get_model_spec("LLAMA")
    experts = 8

    def block(a):
        dense = base.counts.block(a)
        h, f = a.hidden_size, a.ffn_width
        mine = tuple(Linear(f"experts.{w}", experts * o, i, ("ep", "tp")) for w, o, i in
                     (("w1", f, h), ("w2", f, h), ("w3", h, f)))
        return Parameters(dense.linears + mine, dense.others)

    def all_to_all(a, ctx):
        return [Term("expert all-to-all", 4 * ctx.compute_bytes * a.hidden_size, ("tp",))]

    counts = dataclasses.replace(base.counts, block=block, block_communication=all_to_all)
    plan = dataclasses.replace(base.plan, mesh_dims=(MeshDim("ep", "expert", lambda model, ctx: []),))
    register_model(ModelSpec(name="TOY_EXPERTS", module=base.module, build_args=base.build_args, plan=plan,
                             fill_defaults=base.fill_defaults, counts=counts))
    try:
        sets = ["model.dtype=torch.bfloat16", "parallel.tensor=2", "parallel.zero1=-1"]
        dense_cfg = load_config("configs/tiny.py", ["model_type=LLAMA", *sets])
        cfg = load_config("configs/tiny.py", ["model_type=TOY_EXPERTS", *sets])
        cfg.parallel.dims = {"expert": 4}
        a = model_args_from_config(cfg)
        e, d = estimate(cfg, 16), estimate(dense_cfg, 16)
        assert e.layout.dims == {"ep": 4} and "ep 4" in e.layout.describe()
        extra = a.num_layers * experts * 3 * a.ffn_width * a.hidden_size
        assert e.parameters == d.parameters + extra
        # states: every parameter sharded over tp x dp_shard, the experts too (ep is carved out of dp_shard)
        assert e.memory.optimizer == pytest.approx(8 * (d.parameters + extra) / (2 * 8))
        # a gathered block holds its own experts only: 1 / (ep x tp) of them
        per_block = experts * 3 * a.ffn_width * a.hidden_size / (4 * 2)
        assert e.communication.gathered_bytes - d.communication.gathered_bytes == \
            pytest.approx(2 * cfg.data.micro_num * a.num_layers * per_block * 2)
        tokens = cfg.data.micro_bsz * cfg.data.seq_len * cfg.data.micro_num
        assert e.model_communication == {"expert all-to-all": tokens * a.num_layers * 4 * 2 * a.hidden_size / 2}
        assert any(n.startswith("expert all-to-all:") for n in e.notes)
    finally:
        unregister_model("TOY_EXPERTS")
