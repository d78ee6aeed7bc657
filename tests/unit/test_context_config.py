"""parallel.context in the config: an int or a dict, InternEvo's isp tensor mode and sequence_2D mapped onto it (and
logged), the splits it cannot make refused in one line naming the key; ParallelDims' sizes under it."""

from pathlib import Path

import pytest

from internlm_core.config import build_config, load_config
from internlm_core.config.loader import compat_lines
from internlm_core.distributed.parallel_dims import ParallelDims
from internlm_core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.py")
ISP = ROOT / "tests" / "fixtures" / "configs" / "internevo_7B_isp_sft.py"


def _context(cfg):
    c = cfg.parallel.context
    return c.size, c.mode, c.inner


def test_int_and_dict_spellings():
    assert _context(load_config(TINY)) == (1, "ring", 1)
    assert _context(load_config(TINY, ["parallel.context=2"], world_size=2)) == (2, "ring", 1)
    cfg = load_config(TINY, ['parallel.context={"size": 2, "mode": "all_to_all"}'], world_size=4)
    assert _context(cfg) == (2, "all_to_all", 1) and cfg.parallel.tensor == 1
    cfg = load_config(TINY, ["parallel.context={'size': 4, 'mode': '2d', 'head_size': 2}"], world_size=4)
    assert _context(cfg) == (4, "2d", 2)


def test_internevo_isp_is_context_all_to_all_with_tensor_1():
    cfg = load_config(ISP)  # tensor=dict(size=2, mode="isp"), weight=dict(size=4), sequence_2D(enable=False)
    assert _context(cfg) == (2, "all_to_all", 1)
    assert (cfg.parallel.tensor, cfg.parallel.sequence_parallel) == (1, False)
    compat, mapped = compat_lines(cfg)
    assert "parallel.sequence_2D (enable=False)" in compat
    assert ("parallel.tensor.mode='isp' size 2 (InternEvo's intern sequence parallel) -> context parallel 2, mode "
            "all_to_all (Ulysses), parallel.tensor=1") in mapped
    # InternLM develop's spelling of the same mode
    cfg = build_config({"parallel": {"tensor": {"size": 4, "sp": "intern"}}, "data": {"seq_len": 64}})
    assert _context(cfg) == (4, "all_to_all", 1) and cfg.parallel.tensor == 1


def test_internevo_sequence_2d_is_mode_2d_with_inner_head_size():
    cfg = load_config(ISP, ["parallel.tensor.size=8", "parallel.sequence_2D.enable=True"])
    assert _context(cfg) == (8, "2d", 2) and cfg.parallel.tensor == 1
    compat, mapped = compat_lines(cfg)
    assert "2D sequence parallel: context 8, mode 2d, inner (head_size) 2" in mapped
    assert "parallel.sequence_2D.window_size" in compat and "parallel.sequence_2D.device_placement_strategy" in compat


@pytest.mark.parametrize("overrides, message", [
    (["parallel.context=3"], r"data.seq_len \(256\) must be divisible by 2 \* parallel.context.size \(2 \* 3\)"),
    (["parallel.context={'size': 8, 'mode': 'all_to_all'}"],
     r"mode all_to_all exchanges heads over 8 ranks, but each tensor-parallel rank has 4 query heads"),
    (["parallel.context={'size': 2, 'mode': 'all_to_all'}", "parallel.tensor=4"],
     r"mode all_to_all exchanges heads over 2 ranks, but each tensor-parallel rank has 1 query heads"),
    (["parallel.context={'size': 4, 'mode': '2d', 'inner': 3}"], r"parallel.context.inner \(3\) must divide"),
    (["parallel.context={'size': 2, 'mode': 'ulysses'}"], r"parallel.context.mode: expected one of ring, all_to_all, 2d"),
    (["parallel.context={'size': 2, 'width': 2}"], r"parallel.context: unknown key\(s\) \['width'\]"),
    (["parallel.context='two'"], r"parallel.context: expected an int \(the size\) or dict"),
    (["parallel.context=8"], r"world size 4 is not divisible by parallel.tensor \* parallel.pipeline \* "
                             r"parallel.context.size \(1 \* 1 \* 8\)"),
    (["parallel.context=2", "model_type=INTERNLM_MoE", "model.num_experts=4"],
     r"parallel.context.size > 1 with model.moe_type GShard and moe.drop_tokens=True: an expert's capacity would "
     r"be counted over each rank's chunk"),
])
def test_impossible_splits_are_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(TINY, overrides, world_size=4)
    assert str(e.value).startswith(TINY)


def test_isp_conflicts_and_2d_without_isp_are_refused():
    with pytest.raises(ConfigError, match=r"both ask for context parallel; give one"):
        build_config({"parallel": {"tensor": {"size": 2, "mode": "isp"}, "context": 4}})
    with pytest.raises(ConfigError, match=r"head_size \(2\) \* context_size \(4\) must equal the isp tensor size"):
        load_config(ISP, ["parallel.sequence_2D.enable=True"])
    with pytest.raises(ConfigError, match=r"2D sequence parallel runs over the isp tensor group"):
        build_config({"parallel": {"sequence_2D": {"enable": True, "head_size": 2, "context_size": 2}}})


def test_parallel_dims_sizes_under_context_parallel():
    cfg = load_config(TINY, ["parallel.context=2", "parallel.tensor=2", "parallel.zero1=-1"], world_size=8)
    d = ParallelDims.from_config(cfg.parallel, 8)
    # data parallel excludes the context ranks (they read the same rows); FSDP shards and reduces over both
    assert (d.dp, d.cp, d.tp, d.dp_shard, d.dp_shard_cp, d.dp_cp) == (2, 2, 2, 2, 4, 4)
    assert "cp=2" in d.describe()
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by .* parallel.context.size \(1 \* 1 \* 4\)"):
        ParallelDims(world_size=6, cp=4)
    with pytest.raises(ConfigError, match=r"parallel.zero1 \(4\) must divide the data-parallel size \(6 = world size "
                                          r"12 / \(tensor 1 \* pipeline 1 \* context 2\)\)"):
        load_config(TINY, ["parallel.context=2", "parallel.zero1=4"], world_size=12)
