"""The WSD learning-rate schedule (warm-up, stable, decay): its formula for each decay shape, the decay start from
decay_ratio or decay_start_step, a resume that changes the decay start, and the config's rules."""

import math

import pytest
import torch

from internlm_core.config.loader import build_config
from internlm_core.config.optimizer import DECAY_SHAPES as CONFIG_SHAPES
from internlm_core.errors import ConfigError
from internlm_core.optim import WarmupCosineLR, WarmupStableDecayLR
from internlm_core.optim.schedulers import DECAY_SHAPES


def _opt(lr: float = 1.0) -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _curve(sched: WarmupCosineLR, steps: int) -> list[float]:
    lrs = [sched.get_last_lr()[0]]
    for _ in range(steps):
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    return lrs


@pytest.mark.parametrize("shape,frac", [("linear", lambda p: 1 - p), ("cosine", lambda p: (1 + math.cos(math.pi * p)) / 2),
                                        ("1-sqrt", lambda p: 1 - math.sqrt(p))])
def test_wsd_warmup_stable_decay(shape, frac):
    s = WarmupStableDecayLR(_opt(), total_steps=100, warmup_ratio=0.1, eta_min=0.1, decay_ratio=0.2,
                            decay_shape=shape)
    assert s.decay_start_step == 80
    lrs = _curve(s, 110)
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)  # warm-up as the cosine's: (t+1)/W
    assert lrs[10:80] == [1.0] * 70                                        # stable: exactly the peak
    for t in (80, 85, 90, 99):
        assert lrs[t] == pytest.approx(0.1 + 0.9 * frac((t - 80) / 20), abs=1e-12)
    assert lrs[100:] == [pytest.approx(0.1)] * 11                          # eta_min after total_steps
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))                 # never rises after the warm-up


def test_wsd_decay_start_step_overrides_ratio_and_is_checked():
    s = WarmupStableDecayLR(_opt(), total_steps=100, warmup_ratio=0.1, eta_min=0.0, decay_start_step=50,
                            decay_ratio=0.9, decay_shape="linear")
    assert s.decay_start_step == 50 and s.lr_at(49, 1.0) == 1.0 and s.lr_at(75, 1.0) == pytest.approx(0.5)
    with pytest.raises(ConfigError, match=r"lr_scheduler.decay_start_step: the decay must start between the end "
                                          r"of the warm-up \(step 10\) and lr_scheduler.total_steps \(100\), got step 5"):
        WarmupStableDecayLR(_opt(), 100, 0.1, 0.0, decay_start_step=5)
    with pytest.raises(ConfigError, match=r"lr_scheduler.decay_ratio: .* got step 0"):
        WarmupStableDecayLR(_opt(), 100, 0.1, 0.0, decay_ratio=1.0)
    with pytest.raises(ConfigError, match=r"lr_scheduler.decay_shape: expected one of linear, cosine, 1-sqrt"):
        WarmupStableDecayLR(_opt(), 100, 0.1, 0.0, decay_shape="sqrt")
    assert tuple(DECAY_SHAPES) == CONFIG_SHAPES


def test_resume_with_another_decay_start_follows_the_new_schedule():
    """A job planned to decay at step 80, saved at step 40 and resumed with decay_start_step=60, has the lr of a job
    that planned 60 from the start at every step after the resume (bitwise), and resumes either schedule's state."""
    planned = WarmupStableDecayLR(_opt(), 100, 0.05, 0.01, decay_start_step=80)
    _curve(planned, 40)
    state = planned.state_dict()
    assert set(state) == set(WarmupCosineLR(_opt(), 100, 0.05, 0.01).state_dict())  # either resumes the other
    resumed = WarmupStableDecayLR(_opt(), 100, 0.05, 0.01, decay_start_step=60)
    resumed.load_state_dict(state)
    straight = WarmupStableDecayLR(_opt(), 100, 0.05, 0.01, decay_start_step=60)
    assert _curve(resumed, 60) == _curve(straight, 100)[40:]
    # a cosine job's checkpoint into a WSD run (and back): the step carries over, the lr is the new schedule's
    cos = WarmupCosineLR(_opt(), 100, 0.05, 0.01)
    _curve(cos, 70)
    wsd = WarmupStableDecayLR(_opt(), 100, 0.05, 0.01, decay_start_step=60, decay_shape="linear")
    wsd.load_state_dict(cos.state_dict())
    assert wsd.last_step == 70 and wsd.get_last_lr()[0] == pytest.approx(0.01 + 0.99 * 0.75)


def test_config_rules():
    cfg = build_config({"lr_scheduler": {"name": "wsd", "decay_start_step": 30, "decay_shape": "cosine"}})
    assert (cfg.lr_scheduler.name, cfg.lr_scheduler.decay_start_step) == ("wsd", 30)
    with pytest.raises(ConfigError, match=r"lr_scheduler.decay_start_step: a key of the wsd schedule, but "
                                          r"lr_scheduler.name is 'cosine' \(set lr_scheduler.name='wsd'\)"):
        build_config({"lr_scheduler": {"decay_start_step": 30}})
    with pytest.raises(ConfigError, match=r"lr_scheduler.name: expected one of cosine, wsd, got 'step'"):
        build_config({"lr_scheduler": {"name": "step"}})
    with pytest.raises(ConfigError, match=r"lr_scheduler.decay_ratio: expected a fraction in \[0, 1\], got 1.5"):
        build_config({"lr_scheduler": {"name": "wsd", "decay_ratio": 1.5}})


def test_build_schedulers_picks_wsd():
    from internlm_core.trainer.build import build_schedulers
    cfg = build_config({"data": {"total_steps": 50}, "lr_scheduler": {"name": "wsd", "decay_ratio": 0.2}})
    lr, _ = build_schedulers(cfg, _opt())
    assert isinstance(lr, WarmupStableDecayLR) and lr.decay_start_step == 40
