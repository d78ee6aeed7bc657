"""Muon (optimizer.name = "muon"), one process: its Newton-Schulz and step are torch.optim.Muon's (Moonlight's RMS
scaling), its AdamW part is torch's AdamW, bitwise; which parameters take which; its config rules."""

import copy

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from internlm_core.config.loader import build_config
from internlm_core.errors import ConfigError
from internlm_core.model import build_model, model_spec
from internlm_core.optim import build_optimizer
from internlm_core.optim.muon import NS_COEFFICIENTS, Muon, newton_schulz


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) for p in params]


def test_newton_schulz_is_torchs_and_batches_per_matrix():
    g = torch.Generator().manual_seed(0)
    for shape in [(6, 10), (10, 6), (8, 8)]:
        x = torch.randn(shape, generator=g)
        assert torch.equal(newton_schulz(x), _zeropower_via_newtonschulz(x, NS_COEFFICIENTS, 5, 1e-7))
    batch = torch.randn(3, 12, 5, generator=g)
    one_by_one = torch.stack([newton_schulz(m, dtype=torch.float32) for m in batch])
    torch.testing.assert_close(newton_schulz(batch, dtype=torch.float32), one_by_one, rtol=1e-5, atol=1e-6)
    o = newton_schulz(torch.randn(16, 64, generator=g), dtype=torch.float32)
    s = torch.linalg.svdvals(o)
    assert 0.5 < s.min() and s.max() < 1.3  # the quintic's singular values land near 1 (Keller: ~U(0.5, 1.5))


def test_muon_step_is_torch_muon_with_moonlight_scaling():
    ws = [torch.nn.Parameter(torch.randn(8, 24)), torch.nn.Parameter(torch.randn(32, 8))]
    ref = [torch.nn.Parameter(w.detach().clone()) for w in ws]
    ours = Muon([{"params": ws, "use_muon": True}], lr=0.02, weight_decay=0.1)
    theirs = torch.optim.Muon(ref, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for step in range(5):
        for a, b, g in zip(ws, ref, _grads(ws, step)):
            a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    for a, b in zip(ws, ref):
        assert torch.equal(a, b)
    assert torch.equal(ours.state[ws[0]]["momentum_buffer"], theirs.state[ref[0]]["momentum_buffer"])


def test_adamw_part_is_torch_adamw_bitwise():
    ps = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ours = Muon([{"params": ps}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    theirs = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    for step in range(6):
        for a, b, g in zip(ps, ref, _grads(ps, step)):
            a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    for a, b in zip(ps, ref):
        assert torch.equal(a, b)


def test_muon_refuses_a_vector():
    with pytest.raises(ValueError, match=r"Muon: group 'x' holds a 1-D parameter"):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(3))], "use_muon": True, "name": "x"}])


def _tiny(model_type: str, extra: dict) -> tuple:
    raw = {"model_type": model_type, "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                                                "vocab_size": 64, "multiple_of": 16, **extra},
           "data": {"seq_len": 16}, "optimizer": {"name": "muon"}}
    cfg = build_config(raw)
    model = build_model(cfg.model_inputs(), "cpu")
    return cfg, model


@pytest.mark.parametrize("model_type,extra", [("INTERNLM", {}), ("INTERNLM_MoE", {"num_experts": 4})])
def test_split_hidden_matrices_muon_rest_adamw(model_type, extra):
    cfg, model = _tiny(model_type, extra)
    opt = build_optimizer(model, cfg.adam, "foreach", cfg.optimizer, model_spec(cfg).plan.blocks(model))
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["name"]: sorted(names[id(p)] for p in g["params"]) for g in opt.param_groups}
    muon = groups["muon"]
    assert opt.param_groups[0]["ns_dtype"] == "float32"  # muon_ns_dtype "auto" on the CPU
    assert all(n.startswith("layers.") for n in muon)
    assert any("attention" in n for n in muon) and not any("norm" in n or n.endswith("bias") for n in muon)
    adamw = groups["decay"] + groups["no_decay"]
    assert "tok_embeddings.weight" in groups["decay"] and "output.weight" in groups["decay"]
    assert any("norm" in n for n in groups["no_decay"])
    assert sorted(muon + adamw) == sorted(names.values())
    if model_type == "INTERNLM_MoE":
        assert any(n.endswith("gate.weight") for n in groups["decay"])  # the routers: AdamW
        experts = [n for n in muon if ".experts." in n]
        assert experts and all(model.get_parameter(n).dim() == 3 for n in experts)
    model(torch.randint(0, 64, (1, 16)), torch.arange(16)[None], None).float().sum().backward()
    before = copy.deepcopy(model.state_dict())
    opt.step()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters() if p.grad is not None
               and p.grad.abs().sum() > 0)


def test_config_rules():
    with pytest.raises(ConfigError, match=r"optimizer.muon_ns_steps: a key of Muon, but optimizer.name is 'adamw'"):
        build_config({"optimizer": {"muon_ns_steps": 3}})
    with pytest.raises(ConfigError, match=r"optimizer.muon_ns_dtype: expected one of auto, float32, bfloat16, got 'fp8'"):
        build_config({"optimizer": {"name": "muon", "muon_ns_dtype": "fp8"}})
    with pytest.raises(ConfigError, match=r"optimizer.muon_momentum: expected a value in \[0, 1\), got 1.0"):
        build_config({"optimizer": {"name": "muon", "muon_momentum": 1.0}})
    cfg, model = _tiny("INTERNLM", {})
    cfg.adam.fused = "apex"
    with pytest.raises(ConfigError, match=r"adam.fused: 'apex' is AdamW's kernel; optimizer.name='muon'"):
        build_optimizer(model, cfg.adam, "fused", cfg.optimizer, model_spec(cfg).plan.blocks(model))
