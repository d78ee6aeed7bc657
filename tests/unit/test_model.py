"""The transformer: packed attention equals each document alone, backend selection, parameter counts."""

import pytest
import torch

from internlm_core.config import build_config, load_config
from internlm_core.model import analytic_parameter_count, build_model, count_parameters, model_args_from_config


def small_cfg(model_type="INTERNLM", kv=None, **model):
    m = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=97, multiple_of=16, dtype="fp32")
    if kv:
        m["num_kv_attention_heads"] = kv
    m.update(model)
    return build_config({"model_type": model_type, "model": m, "data": {"seq_len": 32, "micro_bsz": 2}})


def packed_inputs(lengths, rows, seq_len, vocab=97, seed=0):
    """Documents of `lengths` packed into rows of seq_len (boundaries at every row start)."""
    g = torch.Generator().manual_seed(seed)
    assert sum(lengths) == rows * seq_len
    ids = torch.randint(0, vocab, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return ids, pos, cu


@pytest.mark.parametrize("model_type,kv", [("INTERNLM", None), ("INTERNLM2", 2), ("LLAMA", 1)])
def test_packed_attention_equals_each_document_alone(model_type, kv):
    torch.manual_seed(0)
    model = build_model(small_cfg(model_type, kv)).eval()
    lengths = [5, 11, 16, 3, 20, 9]  # rows of 32: [5, 11, 16] and [3, 20, 9]
    ids, pos, cu = packed_inputs(lengths, rows=2, seq_len=32)
    with torch.no_grad():
        packed = model(ids.view(2, 32), pos.view(2, 32), cu).view(64, -1)
        # the same documents as one flat row of 64 (the general mask path, no row reshaping)
        flat = model(ids.view(1, 64), pos.view(1, 64), cu).view(64, -1)
        start = 0
        for n in lengths:
            alone = model(ids[start:start + n].view(1, n)).view(n, -1)
            assert (packed[start:start + n] - alone).abs().max().item() <= 1e-5
            assert (flat[start:start + n] - alone).abs().max().item() <= 1e-5
            start += n


def test_one_document_per_row_uses_plain_causal_path():
    from internlm_core.model import build_packed_meta
    cu = torch.tensor([0, 32, 64], dtype=torch.int32)
    meta = build_packed_meta(cu, 2, 32, "sdpa", torch.device("cpu"))
    assert meta.mask is None and meta.cu_seqlens is None
    meta = build_packed_meta(torch.tensor([0, 10, 32, 64], dtype=torch.int32), 2, 32, "cpu_blocked",
                             torch.device("cpu"))
    # blocked attention: one block mask per query block (True = masked out: another document or the future)
    (m,) = meta.block_masks
    assert meta.mask is None and m.shape == (2, 1, 32, 32)
    assert m[0, 0, 10, 9] and not m[0, 0, 9, 0] and m[0, 0, 0, 1] and not m[1, 0, 31, 0]


def test_cu_seqlens_without_row_boundaries_is_rejected():
    from internlm_core.model import build_packed_meta
    with pytest.raises(ValueError, match="every multiple of the row length 32"):
        build_packed_meta(torch.tensor([0, 40, 64], dtype=torch.int32), 2, 32, "sdpa", torch.device("cpu"))


def test_attention_backend_is_given_or_the_plain_one_of_the_device():
    # a run passes the kernel numerics.select_kernels chose (tests/unit/test_kernels.py); a model built outside a
    # run probes nothing and takes the device's plain kernel
    assert model_args_from_config(small_cfg(), "cpu").attn_backend == "cpu_blocked"
    assert model_args_from_config(small_cfg(), "cuda").attn_backend == "sdpa"
    assert model_args_from_config(small_cfg(), "cpu", attn_backend="sdpa").attn_backend == "sdpa"


def test_7b_parameter_count_on_meta_device():
    cfg = load_config("configs/7B.py")
    model = build_model(cfg, "meta")
    assert next(model.parameters()).device.type == "meta"
    n = count_parameters(model)
    assert n == analytic_parameter_count(model_args_from_config(cfg)) == 7_321_948_160
    assert model.layers["0"].feed_forward.w1.out_features == 11008  # 8/3 * 4096 rounded up to 256


@pytest.mark.parametrize("model_type,kv,tie", [("INTERNLM2", 2, False), ("LLAMA", 4, True), ("INTERNLM", None, True)])
def test_analytic_count_matches_built_model(model_type, kv, tie):
    cfg = small_cfg(model_type, kv, tie_word_embeddings=tie)
    model = build_model(cfg)
    assert count_parameters(model) == analytic_parameter_count(model_args_from_config(cfg))
    has_bias = model.layers["0"].attention.wq.bias is not None
    assert has_bias == (model_type == "INTERNLM")


def test_activation_checkpointing_fraction_gives_same_gradients():
    from internlm_core.parallel import checkpoint_and_compile
    torch.manual_seed(0)
    cfg = small_cfg(num_layers=4)
    a, b = build_model(cfg), build_model(cfg)
    b.load_state_dict(a.state_dict())
    assert checkpoint_and_compile(list(b.layers.values()), 0.5, compile=False) == 2
    assert ["forward" in vars(layer) for layer in b.layers.values()] == [True, True, False, False]
    ids = torch.randint(0, 97, (2, 32))
    a(ids).sum().backward()
    b(ids).sum().backward()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), n
