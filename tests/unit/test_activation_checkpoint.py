"""model.checkpoint's policies (issue 38 item 2) on a tiny fp32 model: "selective" recomputation gives the gradients
of no checkpointing bitwise, recomputes fewer FLOPs in backward than "full" (counted by torch's FlopCounterMode:
full repeats every matmul of the blocks' forward, selective none), and its measured peak of live tensors lies
between full's and none's. The policy values the config takes, and the one line refusing others."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from internlm_core.errors import ConfigError
from internlm_core.model import build_model
from internlm_core.parallel import checkpoint_and_compile
from internlm_core.parallel.activation_checkpoint import checkpoint_plan, save_ops
from tests.helpers.live_tensors import LiveTensorBytes
from tests.unit.test_model import small_cfg


def _cfg():
    return small_cfg(num_layers=6, hidden_size=64, vocab_size=97)


def _model(setting, state):
    model = build_model(_cfg())
    model.load_state_dict(state)
    checkpoint_and_compile(list(model.layers.values()), setting, compile=False)
    return model, torch.randint(0, 97, (16, 32), generator=torch.Generator().manual_seed(1))


def _run(setting, state):
    """(parameter gradients, backward FLOPs, peak live bytes of forward + backward) of `setting`: 6 layers, 16 rows
    of 32 tokens (the blocks' activations, not the weights and their gradients, make the peak). The FLOPs and the
    peak are measured in separate runs: FlopCounterMode under LiveTensorBytes changes what is alive."""
    model, ids = _model(setting, state)
    loss = model(ids).float().pow(2).mean()
    with FlopCounterMode(display=False) as flops:
        loss.backward()
    model, ids = _model(setting, state)
    params = list(model.parameters())
    with LiveTensorBytes(exclude=params) as live:
        model(ids).float().pow(2).mean().backward()
    return [p.grad for p in params], flops.get_total_flops(), live.peak


def test_selective_is_bitwise_none_with_fewer_recomputed_flops_and_a_peak_between():
    torch.manual_seed(0)
    state = build_model(_cfg()).state_dict()
    none, full, selective = (_run(s, state) for s in (False, "full", "selective"))
    assert all(torch.equal(a, b) for a, b in zip(selective[0], none[0]))
    assert all(torch.equal(a, b) for a, b in zip(full[0], none[0]))
    # full recomputes the blocks' matmuls (their forward FLOPs), selective keeps every matmul's output
    assert full[1] > none[1] and selective[1] == none[1], (none[1], full[1], selective[1])
    assert full[2] < selective[2] < none[2], (full[2], selective[2], none[2])


def test_policy_values_and_refusal():
    assert checkpoint_plan(True) == ("full", 1.0) and checkpoint_plan(False) == ("full", 0.0)
    assert checkpoint_plan("selective") == ("selective", 1.0) and checkpoint_plan(0.25) == ("full", 0.25)
    with pytest.raises(ConfigError, match=r"model.checkpoint: expected True, False, \"full\", \"selective\" or a "
                                          r"fraction in \[0, 1\], got 'op'"):
        checkpoint_plan("op")
    assert torch.ops.aten.mm.default in save_ops() and torch.ops.aten.add.Tensor not in save_ops()
    assert torch.ops._c10d_functional.all_to_all_single.default in save_ops()


def test_config_takes_the_policy():
    assert small_cfg(checkpoint="selective").model.checkpoint == "selective"
    with pytest.raises(ConfigError, match="model.checkpoint: expected"):
        small_cfg(checkpoint="sometimes")


def test_selective_with_context_parallels_ring_is_refused():
    """Found by the held-out checks of issue 38: model.checkpoint="selective" with context parallel's ring hung in
    the first step (train.py, INTERNLM and QWEN3_MoE at context 2, gloo); refused when the config loads. Ulysses'
    all_to_all mode trains, and so does full checkpointing with the ring."""
    from internlm_core.config import build_config

    model = {"num_attention_heads": 4, "checkpoint": "selective"}
    for context in (2, {"size": 4, "mode": "2d", "inner": 2}):
        with pytest.raises(ConfigError, match=r"^config: model.checkpoint='selective' with context parallel's ring "
                                              r"\(parallel.context mode '(ring|2d)'\): the first step hangs"):
            build_config({"model": model, "parallel": {"context": context}})
    assert build_config({"model": model, "parallel": {"context": {"size": 2, "mode": "all_to_all"}}})
    assert build_config({"model": {**model, "checkpoint": True}, "parallel": {"context": 2}})
