"""parallel.pipeline_schedule (issue 38 item 1): what each schedule needs, refused in one line otherwise (model.compile
with a split backward among them); the V order of the stages; and the estimator's bubble and in-flight micro-batches
simulated from torch's own action lists, equal to the closed forms where there are some."""

from __future__ import annotations

import pytest

from internlm_core.config import build_config
from internlm_core.config.pipeline import check_pipeline_schedule, resolve_schedule, stage_ids
from internlm_core.errors import ConfigError
from internlm_core.estimate.pipeline import profile


def test_auto_resolves_by_chunks_and_each_schedule_says_what_it_needs():
    assert (resolve_schedule("auto", 1), resolve_schedule("auto", 2)) == ("1f1b", "interleaved")
    assert check_pipeline_schedule("zbv", 2, 2, 4, False) == "zbv"
    assert check_pipeline_schedule("interleaved_zb", 2, 1, 4, False) == "interleaved_zb"
    refusals = {
        ("zbv", 2, 1, 4, False): "parallel.pipeline_schedule='zbv' runs exactly two stages per rank in V order: "
                                 "model.num_chunks must be 2, got 1",
        ("dualpipev", 2, 2, 3, False): "parallel.pipeline_schedule='dualpipev' needs data.micro_num >= 2 * "
                                       "parallel.pipeline (4 stages), got 3",
        ("interleaved", 2, 1, 4, False): "parallel.pipeline_schedule='interleaved' needs model.num_chunks > 1 stages "
                                         "per rank, got 1 (use '1f1b')",
        ("1f1b", 2, 2, 4, False): "parallel.pipeline_schedule='1f1b' runs one stage per rank: model.num_chunks must "
                                  "be 1, got 2 (use 'interleaved' or 'interleaved_zb')",
        ("zbv", 1, 2, 4, False): "parallel.pipeline_schedule='zbv': needs parallel.pipeline > 1 (there is no "
                                 "pipeline to schedule)",
        ("gpipe", 2, 1, 4, False): "parallel.pipeline_schedule: expected one of auto, 1f1b, interleaved, "
                                   "interleaved_zb, zbv, dualpipev, got 'gpipe'",
    }
    for args, message in refusals.items():
        with pytest.raises(ConfigError) as err:
            check_pipeline_schedule(*args)
        assert str(err.value) == message


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev", "interleaved_zb"])
def test_compile_with_a_split_backward_is_refused_at_config_time(schedule):
    """torch.compile'd blocks under the split backward gave wrong weight gradients silently (issue 38): refused when
    the config loads, naming why; 1F1B and interleaved 1F1B with compile load."""
    with pytest.raises(ConfigError) as err:
        build_config({"model": {"num_layers": 4, "num_chunks": 2, "compile": True}, "data": {"micro_num": 4},
                      "parallel": {"pipeline": 2, "pipeline_schedule": schedule}})
    assert str(err.value) == (
        f"config: parallel.pipeline_schedule={schedule!r} with model.compile=True: the compiled blocks' backward is "
        f"one graph computing input and weight gradients together, which this schedule's split backward (input pass, "
        f"then weight pass) gets wrong silently (issue 38); use '1f1b' / 'interleaved' or model.compile=False")
    cfg = build_config({"model": {"num_layers": 4, "num_chunks": 2, "compile": True}, "data": {"micro_num": 4},
                        "parallel": {"pipeline": 2}})
    assert cfg.parallel.pipeline_schedule == "auto"


@pytest.mark.parametrize("schedule", ["zbv", "interleaved_zb"])
def test_fused_head_and_selective_checkpointing_with_a_split_backward_are_refused(schedule):
    """Found by the held-out checks: the fused head under a split backward trained with wrong gradients without an
    error (QWEN3_MoE, pipeline 2: gradient norm 39% off at step 1) and selective checkpointing crashed in the weight
    pass ("backward an extra time"): both refused when the config loads ("auto" leaves the head unfused there);
    fractions of full checkpointing load."""
    base = {"data": {"micro_num": 4}, "parallel": {"pipeline": 2, "pipeline_schedule": schedule}}
    model = {"num_layers": 4, "num_chunks": 2 if schedule == "zbv" else 1}
    with pytest.raises(ConfigError, match=rf"^config: model.fused_head_loss=True with parallel.pipeline_schedule="
                                          rf"'{schedule}': the split backward \(input pass, then weight pass\) gives "
                                          rf"the fused head wrong gradients"):
        build_config({**base, "model": {**model, "fused_head_loss": True}})
    with pytest.raises(ConfigError, match=rf"^config: model.checkpoint='selective' with parallel.pipeline_schedule="
                                          rf"'{schedule}': the weight pass recomputes each block again"):
        build_config({**base, "model": {**model, "checkpoint": "selective"}})
    assert build_config({**base, "model": {**model, "checkpoint": 0.5}}).parallel.pipeline_schedule == schedule
    from internlm_core.config.recompute import fused_head_of
    assert fused_head_of(build_config({**base, "model": {**model, "fused_head_loss": "auto"}}), auto=True) is False
    fused = {"data": {"micro_num": 4}, "parallel": {"pipeline": 2, "pipeline_schedule": "1f1b"},
             "model": {"num_layers": 4, "fused_head_loss": True, "checkpoint": "selective"}}
    assert build_config(fused).model.fused_head_loss is True


def test_v_schedules_place_stages_in_v_order():
    assert [stage_ids("zbv", r, 4, 2) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [stage_ids("interleaved_zb", r, 4, 2) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 8), (3, 7)])
def test_simulated_1f1b_and_interleaved_bubbles_are_the_closed_forms(pp, m):
    one = profile("1f1b", pp, 1, m)
    assert one.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))
    assert one.in_flight == tuple(float(min(m, pp - r)) for r in range(pp))  # 1F1B's warm-up forwards
    if m % pp:  # torch's interleaved schedule takes micro_num in rounds of pp
        return
    two = profile("interleaved", pp, 2, m)
    assert two.bubble_fraction == pytest.approx((pp - 1) / (2 * m + pp - 1))
    if m >= 2 * pp:  # the textbook figure
        assert two.in_flight[0] == pytest.approx(min(pp, m) * (1 + (pp - 1) / (pp * 2)))
    else:  # one round (m = pp): torch runs every forward first, all m micro-batches held (not 1.375 m)
        assert two.in_flight[0] == m


def test_zero_bubble_figures():
    """With F = I = W = 1 (B = 2), the figures of torch's zero-bubble schedules on 4 ranks, 8 micro-batches: ZB-V
    and DualPipeV idle 3 of 51 time units (1/17, 5.9%; the ramp-up of the first forward through 7 stages before
    the V turns), ZB1P over 2 chunks the same, ZB1P over 1 chunk (ZB-H1) 3 of 27 (11%), against 1F1B's 3 of 11
    (27%) and interleaved 1F1B's 3 of 19 (16%); every ZB schedule holds at most 4 micro-batches' activations on a
    rank (DualPipeV 4.5), 1F1B's first rank 4."""
    fractions = {(s, v): profile(s, 4, v, 8).bubble_fraction for s, v in
                 (("1f1b", 1), ("interleaved", 2), ("interleaved_zb", 1), ("interleaved_zb", 2), ("zbv", 2),
                  ("dualpipev", 2))}
    assert fractions == pytest.approx({("1f1b", 1): 3 / 11, ("interleaved", 2): 3 / 19, ("interleaved_zb", 1): 3 / 27,
                                       ("interleaved_zb", 2): 3 / 51, ("zbv", 2): 3 / 51, ("dualpipev", 2): 3 / 51})
    assert profile("zbv", 4, 2, 8).in_flight == (4.0,) * 4
    assert profile("dualpipev", 4, 2, 8).in_flight == (4.5,) * 4
