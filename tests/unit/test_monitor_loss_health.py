"""Loss health: consecutive inf/nan stop with a clear message, counts, spike alerts."""

import math

import pytest

from internlm_core.errors import TrainingError
from internlm_core.monitor.alert import AlertManager, WebhookSink
from internlm_core.monitor.loss_health import LossHealthMonitor, build_loss_health
from tests.helpers.webhook_receiver import WebhookReceiver


def metrics(step, loss, skipped=False, grad_norm=1.0, skips=0):
    return {"step": step, "loss": loss, "lr": 1e-4, "grad_norm": grad_norm, "tgs": 100.0,
            "inf_nan_skip_batches": skips, "skipped": skipped}


def test_stops_after_k_consecutive_bad_steps_with_counts():
    with WebhookReceiver() as rx:
        am = AlertManager([WebhookSink(rx.url)], job_name="nanjob")
        h = LossHealthMonitor(max_consecutive_inf_nan=3, alerts=am)
        h.judge(metrics(1, 2.0))
        h.judge(metrics(2, float("nan"), skipped=True, grad_norm=float("nan"), skips=1))
        h.judge(metrics(3, 2.1))  # recovers: the streak resets
        h.judge(metrics(4, float("nan"), skipped=True, grad_norm=float("inf"), skips=2))
        h.judge(metrics(5, 2.0, skipped=True, grad_norm=float("inf"), skips=3))
        assert h.consecutive_bad == 2 and h.total_bad == 3
        with pytest.raises(TrainingError) as ei:
            h.judge(metrics(6, float("inf"), skipped=True, grad_norm=float("nan"), skips=4))
        bodies = rx.wait_for(2)
        am.close()
    assert str(ei.value) == (
        "loss or gradient was inf/nan for 3 consecutive steps (steps 4-6; monitor.max_consecutive_inf_nan=3); "
        "last loss inf, grad_norm nan; 4 updates skipped in total. Stopping instead of training on garbage: "
        "lower the learning rate, check the data, or resume from an earlier checkpoint.")
    # one alert at the start of each streak, none per further bad step
    assert [b["title"] for b in bodies] == ["[WARNING] nanjob: inf/nan at step 2", "[WARNING] nanjob: inf/nan at step 4"]
    assert "the update was skipped (3 skipped in total)" not in bodies[1]["content"]
    assert "step 4: loss nan, grad_norm inf; the update was skipped (2 skipped in total)" == bodies[1]["content"]


def test_inf_grad_norm_alone_is_bad_and_zero_limit_never_stops():
    h = LossHealthMonitor(max_consecutive_inf_nan=0)
    for step in range(50):
        assert h.check(step, 1.0, grad_norm=float("inf")) == "inf_nan"
    assert h.consecutive_bad == 50


def test_spike_alert_after_warmup_once_per_event():
    with WebhookReceiver() as rx:
        am = AlertManager([WebhookSink(rx.url)], job_name="spike")
        h = LossHealthMonitor(spike_ratio=1.5, warmup_steps=5, ema_decay=0.5, alerts=am)
        verdicts = [h.check(s, 10.0 if s == 1 else 2.0) for s in range(1, 6)]  # high loss inside warm-up
        verdicts += [h.check(6, 2.0), h.check(7, 6.0), h.check(8, 6.5), h.check(9, 2.0), h.check(10, 9.0)]
        bodies = rx.wait_for(2)
        am.close()
    assert verdicts == ["ok"] * 6 + ["spike", "spike", "ok", "spike"]
    assert h.spikes == 3
    assert [b["title"] for b in bodies] == ["[WARNING] spike: loss spike at step 7", "[WARNING] spike: loss spike at step 10"]
    # EMA (decay 0.5) of 10, 2, 2, 2, 2, 2 is 2.25
    assert bodies[0]["content"] == ("loss spike at step 7: loss 6.0000 is 2.67x the running average 2.2500 "
                                    "(monitor.loss_spike_ratio 1.5)")


def test_only_rank0_alerts_but_every_rank_stops():
    with WebhookReceiver() as rx:
        am = AlertManager([WebhookSink(rx.url)])
        h = LossHealthMonitor(max_consecutive_inf_nan=2, alerts=am, rank=1)
        h.check(1, float("nan"))
        with pytest.raises(TrainingError, match="for 2 consecutive steps"):
            h.check(2, float("nan"))
        am.flush(5)
        am.close()
        assert rx.received == []


def test_state_dict_round_trip_and_tensor_loss():
    import torch

    h = LossHealthMonitor(spike_ratio=2.0, warmup_steps=1)
    h.check(1, torch.tensor(3.0))
    h.check(2, torch.tensor(float("nan")))
    sd = h.state_dict()
    assert all(isinstance(v, (int, float)) for v in sd.values())
    h2 = LossHealthMonitor(spike_ratio=2.0, warmup_steps=1)
    h2.load_state_dict(sd)
    assert (h2.ema, h2.consecutive_bad, h2.first_bad_step, h2.good_steps) == (3.0, 1, 2, 1)
    assert h2.check(3, 7.0) == "spike"
    fresh = LossHealthMonitor()
    fresh.load_state_dict(LossHealthMonitor().state_dict())
    assert fresh.ema is None and fresh.first_bad_step is None and math.isnan(LossHealthMonitor().state_dict()["ema"])


def test_build_from_config():
    class Cfg:
        loss_spike_ratio = 1.8
        max_consecutive_inf_nan = 4

    h = build_loss_health(Cfg(), rank=0, warmup_steps=3)
    assert (h.spike_ratio, h.max_consecutive_inf_nan, h.warmup_steps) == (1.8, 4, 3)


def test_spike_streak_and_unhealthy_reasons():
    h = LossHealthMonitor(spike_ratio=1.5, warmup_steps=3, ema_decay=0.5)
    for s in range(1, 5):
        h.check(s, 2.0)
    assert h.unhealthy() is None
    h.check(5, 5.0)  # EMA 2 -> 3.5
    h.check(6, 8.0)
    assert h.spike_streak == [5, 6]
    assert h.unhealthy() is None  # spikes only alert unless a rewind vetoes saves during them
    assert h.unhealthy(spikes=True) == "loss spike since step 5 (2 step(s))"
    h.check(7, 2.0)
    assert h.spike_streak == [] and h.unhealthy(spikes=True) is None
    h.check(8, float("nan"))
    h.check(9, 2.0, skipped=True)
    assert h.unhealthy() == "loss or gradient inf/nan for 2 step(s) in a row since step 8"
    h.check(10, 2.0)
    assert h.unhealthy() is None
