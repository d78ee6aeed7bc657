"""TrainState, BatchSkipper, schedules, grad scaler, parameter groups, clipping."""

import math

import pytest
import torch

from internlm_core.config.schema import GradScalerConfig
from internlm_core.errors import ConfigError
from internlm_core.optim import Beta2Scheduler, DynamicGradScaler, WarmupCosineLR, clip_and_check, param_groups
from internlm_core.trainer.state import BatchSkipper, TrainState, parse_skip_batches


def test_batch_skipper_semantics():
    assert parse_skip_batches("3,10-12, 20") == {3, 10, 11, 12, 20}
    assert parse_skip_batches("") == set()
    s = BatchSkipper("3,10-20")
    hits = [i for i in range(30) if s(i)]
    assert hits == [3] + list(range(10, 21)) and s.num_skipped == 12
    with pytest.raises(ConfigError, match=r"data.skip_batches: cannot read 'x' in '1,x'"):
        BatchSkipper("1,x")
    with pytest.raises(ConfigError, match=r"cannot read '9-3'"):
        parse_skip_batches("9-3")


def test_train_state_round_trip():
    st = TrainState("tb")
    st.batch_count, st.step_count, st.num_consumed_tokens, st.inf_nan_skip_batches = 12, 10, 4096, 2
    st.num_consumed_samples_in_epoch = 24
    other = TrainState("elsewhere")
    other.load_state_dict(st.state_dict())
    assert other.state_dict() == st.state_dict()


def test_warmup_cosine_matches_internlm_formula():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=1.0)
    s = WarmupCosineLR(opt, total_steps=100, warmup_ratio=0.1, eta_min=0.1)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(100):
        s.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)   # (t+1)/W
    assert lrs[10] == pytest.approx(1.0)
    assert lrs[55] == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi * 45 / 90)) / 2)
    assert lrs[100] == pytest.approx(0.1)
    # state round trip lands on the same lr
    opt2 = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    s2 = WarmupCosineLR(opt2, total_steps=100, warmup_ratio=0.1, eta_min=0.1)
    s.last_step = 37
    s2.load_state_dict(s.state_dict())
    assert opt2.param_groups[0]["lr"] == pytest.approx(s.lr_at(37, 1.0))


def test_beta2_schedule():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], betas=(0.9, 0.95))
    s = Beta2Scheduler(opt, init_beta2=0.95, c=0.8)
    for _ in range(1000):
        s.step()
    assert opt.param_groups[0]["betas"][1] == pytest.approx(max(0.95, 1 - 1000**-0.8))
    const = Beta2Scheduler(opt, init_beta2=0.9, c=0)
    const.step()
    assert opt.param_groups[0]["betas"][1] == 0.9


def test_grad_scaler_hysteresis_and_growth():
    s = DynamicGradScaler(GradScalerConfig(initial_scale=16, growth_interval=3, hysteresis=2, min_scale=4, max_scale=32))
    s.update(True)
    assert s.scale == 16  # first overflow tolerated
    s.update(True)
    assert s.scale == 8
    s.update(True)
    assert s.scale == 4
    s.update(True)
    assert s.scale == 4  # min_scale
    for _ in range(3):
        s.update(False)
    assert s.scale == 8
    t = DynamicGradScaler(GradScalerConfig())
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()


def test_adam_param_groups():
    # which AdamW implementation runs is numerics.select_kernels' decision: tests/unit/test_kernels.py
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.RMSNorm(4))
    groups = param_groups(model, 0.1)
    assert [len(g["params"]) for g in groups] == [1, 2]  # weight decays; bias and norm do not
    assert groups[1]["weight_decay"] == 0.0


def test_clip_and_inf_detection():
    a = torch.nn.Parameter(torch.zeros(3))
    a.grad = torch.tensor([3.0, 4.0, 0.0])
    norm, finite = clip_and_check([a], max_norm=1.0)
    assert finite and norm == pytest.approx(5.0)
    assert a.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
    a.grad = torch.tensor([float("nan"), 1.0, 0.0])
    norm, finite = clip_and_check([a], max_norm=1.0)
    assert not finite and math.isnan(norm)
