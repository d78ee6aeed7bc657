"""InternEvo's INTERNLM_MoE checkpoint folders read where the dense reader reads them (ckpt_type internlm /
internevo): the dense part as model_tp{t}_pp{p}.pt, the experts in InternEvo's own files
`model_moe_layer{L}_expert{e}_tp{t}.pt` (global layer L in the name, the stage's block number in the keys).

The expert files of the hand-written folders below are made here from InternEvo's save code's naming (not by our
writer): both FeedForward namings InternEvo used, experts tensor-sharded and whole (parallel.expert.no_tp)."""

import re

import pytest
import torch

from internlm_core.checkpoint.internlm_format import load_internlm, write_internlm_folder
from internlm_core.config import load_config
from internlm_core.errors import CheckpointError
from internlm_core.model import build_model


def moe_cfg(*extra):
    return load_config("configs/tiny.py", ["model_type=INTERNLM_MoE", "model.num_experts=4", "moe.top_k=2",
                                           "model.vocab_size=96", "data.seq_len=16", "model.hidden_size=64",
                                           "model.num_attention_heads=4", "model.num_layers=2",
                                           "model.multiple_of=32", *extra])


def random_model(cfg, seed=0):
    torch.manual_seed(seed)
    m = build_model(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m.eval()


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_written_folder_has_internevos_files_and_reads_back(tmp_path, tp, pp):
    cfg = moe_cfg("model.moe_use_residual=True")
    model = random_model(cfg)
    write_internlm_folder(tmp_path, cfg, model.state_dict(), tp=tp, pp=pp, dtype="float32")
    names = sorted(p.name for p in tmp_path.iterdir())
    experts = [n for n in names if n.startswith("model_moe_layer")]
    assert len(experts) == 2 * 4 * tp and "model_moe_layer1_expert3_tp0.pt" in experts
    # the dense files hold the router and the residual MLP, not the experts
    stage = torch.load(tmp_path / f"model_tp0_pp{pp - 1}.pt", weights_only=True)
    assert "model.blocks.0.mlp.moe_layer.gate.wg.weight" in stage and "model.blocks.0.mlp.coefficient.bias" in stage
    assert not any("wrapped_experts" in k for k in stage)
    one = torch.load(tmp_path / "model_moe_layer1_expert3_tp0.pt", weights_only=True)
    local = 0 if pp == 2 else 1  # the second stage numbers its blocks from 0
    assert sorted(one) == [f"model.blocks.{local}.mlp.moe_layer.experts.wrapped_experts.3.w{i}.weight"
                           for i in (1, 2, 3)]
    fresh = build_model(cfg)
    load_internlm(fresh, tmp_path, "INTERNLM_MoE")
    assert_same_state(model, fresh.eval())


@pytest.mark.parametrize("naming", ["later", "v1"])
def test_hand_written_expert_files_in_both_feedforward_namings_and_no_tp(tmp_path, naming):
    """InternEvo's expert files written from its save code's rules: experts whole (expert no_tp: tensor rank 0 only)
    beside dense files split over 2 tensor ranks and 2 stages; `naming` "v1" is the early MoE releases' FeedForward
    (w2 up, w3 down), "later" today's (w3 up, w2 down)."""
    cfg = moe_cfg()
    model = random_model(cfg, seed=1)
    sd = model.state_dict()
    write_internlm_folder(tmp_path, cfg, sd, tp=2, pp=2, dtype="float32")
    for f in tmp_path.glob("model_moe_layer*"):
        f.unlink()
    for layer in range(2):
        w1, w3, w2 = (sd[f"layers.{layer}.feed_forward.experts.{w}"] for w in ("w1", "w3", "w2"))
        up_name, down_name = ("w2", "w3") if naming == "v1" else ("w3", "w2")
        for e in range(4):
            pre = f"model.blocks.0.mlp.moe_layer.experts.wrapped_experts.{e}."  # layer 0 of its stage
            torch.save({pre + "w1.weight": w1[e].clone(), pre + f"{up_name}.weight": w3[e].clone(),
                        pre + f"{down_name}.weight": w2[e].clone()},
                       tmp_path / f"model_moe_layer{layer}_expert{e}_tp0.pt")
    fresh = build_model(cfg)
    load_internlm(fresh, tmp_path, "INTERNLM_MoE")
    assert_same_state(model, fresh.eval())
    tokens = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(tokens), fresh(tokens))


def test_a_missing_expert_file_is_named(tmp_path):
    cfg = moe_cfg()
    write_internlm_folder(tmp_path, cfg, random_model(cfg).state_dict(), tp=1, pp=1, dtype="float32")
    (tmp_path / "model_moe_layer1_expert2_tp0.pt").unlink()
    with pytest.raises(CheckpointError, match=re.escape("layer 1: experts [0, 1, 3] found, expected 0..N-1 "
                                                        "(a model_moe_layer1_expert*_tp*.pt file is missing)")):
        load_internlm(build_model(cfg), tmp_path, "INTERNLM_MoE")


def test_experts_split_over_weight_parallel_ranks_are_refused(tmp_path):
    cfg = moe_cfg()
    write_internlm_folder(tmp_path, cfg, random_model(cfg).state_dict(), tp=1, pp=1, dtype="float32")
    (tmp_path / "model_moe_layer0_expert0_tp0.pt").rename(tmp_path / "model_moe_layer0_expert0_wp1.pt")
    with pytest.raises(CheckpointError, match="model_moe_layer0_expert0_wp1.pt: experts split over InternEvo's expert "
                                              "weight-parallel ranks"):
        load_internlm(build_model(cfg), tmp_path, "INTERNLM_MoE")
