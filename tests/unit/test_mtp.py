"""model.mtp (multi-token prediction, model/mtp.py) on one process: each depth's targets never cross a document nor
a context chunk, the depths' module against a hand-written reference, the pipeline's carried embeddings, the loss
term under the loss contract, the config spellings and refusals, the counts."""

import pytest
import torch
import torch.nn.functional as F

from internlm_core.config import build_config
from internlm_core.errors import ConfigError
from internlm_core.model import (analytic_parameter_count, build_model, count_parameters,
                                 document_ids_from_cu_seqlens, model_args_from_config)
from internlm_core.model.mtp import mtp_module, mtp_settings, mtp_targets, pop_mtp_logits
from internlm_core.parallel.context import ContextCut

LENGTHS = [1, 2, 3, 5, 7, 14, 4, 2, 26]  # rows of 32: [1, 2, 3, 5, 7, 14] and [4, 2, 26]
DEPTH = 3


def small_cfg(model_type="INTERNLM2", **model):
    m = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=61, multiple_of=16,
             dtype="torch.float32", mtp=dict(depth=2, loss_weight=0.5))
    m.update(model)
    return build_config({"model_type": model_type, "model": m, "data": {"seq_len": 32, "micro_bsz": 2}})


def packed_row(seed=0):
    """Two rows of 32 tokens packing LENGTHS, labels shifted within each document (-100 at its end) and a few more
    masked (-100) as a data's loss mask would; (ids, labels, positions, cu_seqlens, document ids)."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, 61, (n,), generator=g) for n in LENGTHS]
    labels = [torch.cat([d[1:], torch.tensor([-100])]) for d in docs]
    labels[5][3] = labels[8][10] = -100  # masked by the data
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).view(2, 32)
    return (torch.cat(docs).view(2, 32), torch.cat(labels).view(2, 32), positions, cu,
            document_ids_from_cu_seqlens(cu, 2, 32))


def reference_targets(ids, labels, depth):
    """Depth targets document by document: depth k at j reads t_{j+k} and l_{j+k} of the same document only."""
    flat_ids, flat_labels = ids.flatten(), labels.flatten()
    out_ids, out_labels, start = [], [], 0
    for n in LENGTHS:
        t, lab = flat_ids[start:start + n], flat_labels[start:start + n]
        out_ids.append(torch.stack([torch.cat([t[k:], torch.zeros(k, dtype=t.dtype)])[:n]
                                    for k in range(1, depth + 1)], -1))
        out_labels.append(torch.stack([torch.cat([lab[k:], torch.full((k,), -100)])[:n]
                                       for k in range(1, depth + 1)], -1))
        start += n
    return torch.cat(out_ids).view(2, 32, depth), torch.cat(out_labels).view(2, 32, depth)


def test_every_depths_targets_stay_in_their_document():
    ids, labels, _, _, docs = packed_row()
    got_ids, got_labels = mtp_targets(ids, labels, docs, DEPTH)
    want_ids, want_labels = reference_targets(ids, labels, DEPTH)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_labels, want_labels)
    # a shift of the whole row (ignoring the documents) differs: the test sees a crossing
    rolled = torch.roll(labels, -1, dims=1)
    assert not torch.equal(rolled, got_labels[..., 0])
    # depth k of a document of n tokens counts at most n - 1 - k targets (the 1-token document none)
    assert (got_labels[0, 0] == -100).all() and (got_labels[0, 1:3, 1:] == -100).all()


def test_targets_are_shifted_before_the_context_cut():
    """Each context rank's chunk of the targets is the whole rows' targets at its tokens; shifting the cut chunk
    instead (Megatron's bug) pulls tokens of the next chunk; the depths' shares add up to 1 per depth."""
    ids, labels, positions, cu, docs = packed_row()
    mtp_ids, mtp_labels = mtp_targets(ids, labels, docs, DEPTH)
    mb = {"input_ids": ids, "labels": labels, "position_ids": positions, "type_ids": torch.zeros_like(ids),
          "cu_seqlens": cu, "mtp_ids": mtp_ids, "mtp_labels": mtp_labels}
    shares = torch.zeros(DEPTH, dtype=torch.float64)
    for rank in range(2):
        cut = ContextCut(2, rank)
        out, idx = cut(mb), cut.indices(32)
        assert torch.equal(out["mtp_ids"], mtp_ids[:, idx]) and torch.equal(out["mtp_labels"], mtp_labels[:, idx])
        shifted_after_cut = mtp_targets(out["input_ids"], out["labels"], out["document_ids"], DEPTH)[1]
        assert not torch.equal(shifted_after_cut, out["mtp_labels"])
        for k in range(DEPTH):
            assert out["mtp_shares"][k] == int((mtp_labels[:, idx][..., k] != -100).sum()) / \
                int((mtp_labels[..., k] != -100).sum())
        shares += torch.tensor(out["mtp_shares"], dtype=torch.float64)
    assert torch.allclose(shares, torch.ones(DEPTH, dtype=torch.float64))


def _hidden_before_norm(model, ids, positions, cu):
    seen = {}
    hook = model.norm.register_forward_pre_hook(lambda m, args: seen.update(h=args[0]))
    logits = model(ids, positions, cu)
    hook.remove()
    return logits, seen["h"]


def test_depths_match_a_hand_written_reference_and_leave_the_main_logits():
    cfg = small_cfg()
    model = build_model(cfg, seed=3)
    ids, labels, positions, cu, docs = packed_row()
    mtp_ids, _ = mtp_targets(ids, labels, docs, 2)
    with torch.no_grad():
        main, h = _hidden_before_norm(model, ids, positions, cu)
        out = model(ids, positions, cu, mtp_ids=mtp_ids)
        got = pop_mtp_logits(mtp_module(model))
        assert pop_mtp_logits(mtp_module(model)) == []  # popped once
        assert torch.equal(out, main)
        # the same weights without model.mtp: the main logits do not change
        plain = build_model(small_cfg(mtp=None), seed=3)
        assert torch.allclose(plain(ids, positions, cu), main, atol=1e-6)
        cos = model.rope.cos[positions].unsqueeze(2)
        sin = model.rope.sin[positions].unsqueeze(2)
        from internlm_core.model import build_packed_meta
        meta = build_packed_meta(cu, 2, 32, model.args.attn_backend, ids.device)
        for k, depth in enumerate(model.mtp.depths.values()):
            e = model.tok_embeddings(mtp_ids[..., k])
            x = depth.eh_proj(torch.cat([depth.enorm(e), depth.hnorm(h)], -1))  # [embedding; hidden]
            h = depth.block(x, cos, sin, meta)
            assert torch.allclose(got[k], model.output(depth.norm(h)), atol=1e-6), k


def test_the_trainer_term_is_the_weighted_mean_of_the_depths_cross_entropy():
    from internlm_core.loss import FlashGPTLMLoss
    from internlm_core.loss_norm import LossNormalizer
    from internlm_core.trainer.mtp import MTPLoss

    class Dims:  # one process
        dp = cp = pp_dp = 1

        def group(self, name):
            return None

    model = build_model(small_cfg(), seed=1)
    ids, labels, positions, cu, _ = packed_row()
    batch = {"input_ids": ids.view(1, 64), "labels": labels.view(1, 64), "cu_seqlens": [cu]}
    for reduction in ("token_mean", "micro_batch_mean"):
        mtp = MTPLoss(2, 0.5, FlashGPTLMLoss("torch"), mtp_module(model), reduction, Dims(), torch.device("cpu"))
        mb = mtp.targets(batch, 0, {"input_ids": ids, "labels": labels}, 32)
        norm = LossNormalizer.of_step(reduction, 1, Dims(), labels, torch.device("cpu"))
        model(ids, positions, cu, mtp_ids=mb["mtp_ids"])
        logits = [lg.detach() for lg in mtp.module.pending]
        term = mtp.term(norm, mb["mtp_labels"])
        ce = [F.cross_entropy(lg.reshape(-1, 61), mb["mtp_labels"][..., k].reshape(-1)) for k, lg in enumerate(logits)]
        main_n = int((labels != -100).sum())
        # backpropagated with the main loss's factor, it is 0.5 * the mean of the depths' token means
        factor = norm.backward_factor(1.0) if reduction == "token_mean" else 1.0
        assert float(term.detach() * factor) == pytest.approx(0.5 * sum(float(c) for c in ce) / 2, rel=1e-5), reduction
        term.backward()
        assert model.mtp.depths["1"].eh_proj.weight.grad.abs().sum() > 0 and model.tok_embeddings.weight.grad is not None
        model.zero_grad()
        assert mtp.step_metrics(Dims())["mtp_loss"] == pytest.approx(sum(float(c) for c in ce) / 2, rel=1e-5)
        assert main_n > 0


def test_pipeline_stages_carry_the_depths_embeddings():
    """Split in two stages, the first sends the depths' embeddings with its hidden states, the last runs the depths:
    the logits of both the main model and every depth equal the whole model's, and the first stage's embedding gets
    the depths' gradient through the stage boundary."""
    from internlm_core.model.spec import get_model_spec
    cfg = small_cfg()
    spec = get_model_spec("INTERNLM2")
    whole = build_model(cfg, seed=2)
    first, _ = spec.plan.split_stages(build_model(cfg, seed=2), [0], 2)
    last, _ = spec.plan.split_stages(build_model(cfg, seed=2), [1], 2)
    assert first.mtp is None and mtp_module(last) is not None and last.tok_embeddings is None
    assert len(spec.plan.blocks(last)) == 1 + 2  # its block and the depths' (checkpointing, FSDP units)
    ids, labels, positions, cu, docs = packed_row()
    mtp_ids, _ = mtp_targets(ids, labels, docs, 2)
    want = whole(ids, positions, cu, mtp_ids=mtp_ids)
    want_depths = pop_mtp_logits(mtp_module(whole))
    sent = first(ids, positions, cu, mtp_ids=mtp_ids)
    assert sent.shape == (2, 32, 32 * 3)
    received = sent.detach().requires_grad_()
    got = last(received, positions, cu)
    got_depths = pop_mtp_logits(mtp_module(last))
    assert torch.allclose(got, want, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got_depths, want_depths))
    sum(d.sum() for d in got_depths).backward()
    assert received.grad[..., 32:].abs().sum() > 0  # the depths' embeddings get their gradient back
    # evaluation sends no depth ids: the stages pass plain hidden states and no depth runs
    assert first(ids, positions, cu).shape == (2, 32, 32)


def test_mtp_config_spellings_and_refusals():
    assert mtp_settings(None).depth == 0 and mtp_settings(2).depth == 2
    assert mtp_settings({"depth": 1, "loss_weight": 0.1}).loss_weight == 0.1
    cfg = build_config({"model_type": "INTERNLM2", "model": {"num_nextn_predict_layers": 1}})
    assert cfg.model.mtp == {"depth": 1}
    cfg = build_config({"model_type": "INTERNLM2", "model": {"mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.1}})
    assert mtp_settings(cfg.model.mtp) == mtp_settings({"depth": 2, "loss_weight": 0.1})
    with pytest.raises(ConfigError, match=r"^model.mtp.depth: expected an int >= 0 \(0: off\), got -1$"):
        mtp_settings({"depth": -1})
    with pytest.raises(ConfigError, match=r"^model.mtp.weight: unknown key; expected depth, loss_weight$"):
        mtp_settings({"weight": 1})
    with pytest.raises(ConfigError, match=r"^config: model.num_nextn_predict_layers=2: model.mtp already sets depth=1$"):
        build_config({"model_type": "INTERNLM2", "model": {"mtp": 1, "num_nextn_predict_layers": 2}})
    with pytest.raises(ConfigError, match=r"^config: model.mtp: not with parallel.tensor=2 "):
        build_config({"model_type": "INTERNLM2", "model": {"mtp": 1}, "parallel": {"tensor": 2}}, world_size=2)
    with pytest.raises(ConfigError, match=r"^config: model.fused_head_loss: not with model.mtp "):
        build_config({"model_type": "INTERNLM2", "model": {"mtp": 1, "fused_head_loss": True}})
    from internlm_core.config.recompute import fused_head_of
    assert not fused_head_of(build_config({"model_type": "INTERNLM2", "model": {"mtp": 1, "fused_head_loss": "auto",
                                                                                 "vocab_size": 200_000}}))


def test_counts_include_the_depths():
    cfg = small_cfg()
    args = model_args_from_config(cfg)
    model = build_model(cfg)
    assert count_parameters(model) == analytic_parameter_count(args)
    plain = count_parameters(build_model(small_cfg(mtp=None)))
    h = 32
    block = sum(p.numel() for p in model.layers["0"].parameters())
    assert count_parameters(model) - plain == 2 * (block + 2 * h * h + 3 * h)


@pytest.mark.parametrize("model_type,extra", [("INTERNLM2", {}), ("INTERNLM_MoE", {"num_experts": 4})])
def test_the_estimator_counts_the_depths(model_type, extra):
    """Its parameters are the built model's (the depths' blocks are the family's: an MoE block for MoE families),
    and the last stage keeps more: the depths' blocks and each depth's logits with their stored gradient."""
    from internlm_core.estimate import estimate

    def cfg(mtp):
        return build_config({"model_type": model_type, "data": {"seq_len": 32, "micro_bsz": 1, "micro_num": 2},
                             "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 61,
                                       "multiple_of": 16, "dtype": "torch.float32", "mtp": mtp, **extra}})
    with_depth, without = estimate(cfg({"depth": 1}), 1, device="cpu"), estimate(cfg(None), 1, device="cpu")
    assert with_depth.parameters == count_parameters(build_model(cfg({"depth": 1})))
    assert with_depth.parameters > without.parameters == count_parameters(build_model(cfg(None)))
    assert with_depth.memory.activations - without.memory.activations >= 2 * 32 * 2 * 4 * 61  # the depth's logits


def test_an_moe_familys_depths_route_and_report_under_their_own_name():
    from internlm_core.model.internlm_moe.hooks import moe_named_layers, moe_step_metrics
    model = build_model(small_cfg("INTERNLM_MoE", num_experts=4), seed=0)
    assert [i for i, _ in moe_named_layers(model)] == ["0", "1", "mtp0", "mtp1"]
    ids, labels, positions, cu, docs = packed_row()
    model(ids, positions, cu, mtp_ids=mtp_targets(ids, labels, docs, 2)[0])
    metrics = moe_step_metrics(model)
    assert {"moe/layer0/max_load", "moe/layermtp1/max_load"} <= set(metrics)


@pytest.mark.parametrize("model_type,extra", [("INTERNLM2", {}), ("INTERNLM_MoE", {"num_experts": 4})])
def test_flops_per_token_count_the_depths(model_type, extra):
    """Each depth adds a block's FLOPs (its matmuls and attention), eh_proj's and the output layer's once more."""
    from internlm_core.model import model_flops_per_token
    on, off = small_cfg(model_type, **extra), small_cfg(model_type, mtp=None, **extra)
    args_on, args_off = model_args_from_config(on), model_args_from_config(off)
    h, v = 32, 61
    added = model_flops_per_token(on, args_on) - model_flops_per_token(off, args_off)
    per_block = (model_flops_per_token(off, args_off) - 6 * v * h) / 2  # 2 blocks, the head aside
    assert added == pytest.approx(2 * (per_block + 6 * (2 * h * h + v * h)), rel=0.02)


def test_depths_round_trip_through_deepseeks_hf_layout():
    """Our depths <-> DeepSeek's model.layers.{L+k}.{enorm, hnorm, eh_proj, shared_head.norm, block tensors}, with
    the copies of the embedding and output head written on export and checked on import (Llama's layer names
    standing in for a family's block mapping)."""
    from internlm_core.errors import CheckpointError
    from internlm_core.model.internlm.hf import llama_to_ours_name, ours_to_llama_name
    from internlm_core.model.mtp_hf import copies_to_hf, is_mtp_layer, mtp_from_hf, mtp_to_hf
    cfg = small_cfg()
    args, sd = model_args_from_config(cfg), build_model(cfg, seed=4).state_dict()
    hf = {}
    for k, v in sd.items():
        if k.startswith("mtp."):
            hf.update(mtp_to_hf(k, v, args, lambda n, t: {ours_to_llama_name(n): t}))
        else:
            hf[ours_to_llama_name(k)] = v
            hf.update(copies_to_hf(k, v, args))
    assert {"model.layers.2.enorm.weight", "model.layers.3.shared_head.norm.weight", "model.layers.2.eh_proj.weight",
            "model.layers.3.self_attn.q_proj.weight", "model.layers.2.embed_tokens.weight",
            "model.layers.3.shared_head.head.weight"} <= set(hf)
    assert not is_mtp_layer("model.layers.1.self_attn.q_proj.weight", args) and is_mtp_layer("model.layers.3.x", args)
    depths = {k: v for k, v in hf.items() if is_mtp_layer(k, args)}
    back = mtp_from_hf(depths, args, lambda block: {llama_to_ours_name(k): v for k, v in block.items()}, hf)
    assert back.keys() == {k for k in sd if k.startswith("mtp.")}
    assert all(torch.equal(back[k], sd[k]) for k in back)
    hf["model.layers.3.shared_head.head.weight"] = hf["lm_head.weight"] + 1
    with pytest.raises(CheckpointError, match=r"^model.layers.3.shared_head.head.weight differs from lm_head.weight"):
        mtp_from_hf({k: v for k, v in hf.items() if is_mtp_layer(k, args)}, args,
                    lambda block: {llama_to_ours_name(k): v for k, v in block.items()}, hf)


def test_the_pipeline_gives_a_context_chunks_depths_their_shares():
    """micro_batch_mean under pipeline x context parallel: the pipeline's term of a context chunk (looked up by the
    micro-batch's index in the stacked micro-batches) is the plain loop's, each depth weighted by its share of its
    counted targets (before, the pipeline dropped the shares: mtp_loss cp times too large under pp2 x cp2)."""
    from types import SimpleNamespace

    from internlm_core.loss import FlashGPTLMLoss
    from internlm_core.loss_norm import LossNormalizer
    from internlm_core.parallel.pipeline import stack_micro_batches
    from internlm_core.trainer.mtp import MTPLoss

    rows = [packed_row(seed) for seed in (0, 1)]
    batch = {"input_ids": torch.stack([r[0].flatten() for r in rows]),
             "labels": torch.stack([r[1].flatten() for r in rows]), "cu_seqlens": [r[3] for r in rows]}
    dims = SimpleNamespace(dp=1, cp=2, group=lambda name: None)
    module = SimpleNamespace(pending=[])
    loss = MTPLoss(DEPTH, 0.5, FlashGPTLMLoss("torch"), module, "micro_batch_mean", dims, torch.device("cpu"))
    cut = ContextCut(2, 1)
    chunks = [cut(loss.targets(batch, i, {"input_ids": ids, "labels": labels, "position_ids": pos,
                                          "type_ids": torch.zeros_like(ids), "cu_seqlens": cu}, 32))
              for i, (ids, labels, pos, cu, _) in enumerate(rows)]
    stacked, norm = stack_micro_batches(chunks), LossNormalizer(2, 1, 2, "micro_batch_mean")
    g = torch.Generator().manual_seed(5)
    for i, chunk in enumerate(chunks):
        assert all(0 < s < 1 for s in chunk["mtp_shares"])
        logits = [torch.randn(2, 16, 61, generator=g) for _ in range(DEPTH)]
        module.pending = list(logits)
        plain = loss.term(norm, chunk["mtp_labels"], chunk["mtp_shares"])
        module.pending = list(logits)
        assert torch.allclose(loss.term_at(norm, stacked, torch.tensor(i)), plain, rtol=1e-6, atol=0)
