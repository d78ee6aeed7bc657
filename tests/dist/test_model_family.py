"""A family registered from outside internlm_core trains under one process, data parallel (FSDP) and tensor
parallel with the same losses: the framework reaches models only through their spec."""

import pytest

from internlm_core.errors import ConfigError
from internlm_core.model import unregister_model
from tests.dist.toy_family import register
from tests.helpers.launch import read_metrics, run_train

pytestmark = pytest.mark.slow

STEPS = 6
ARGS = ["--config", "configs/tiny.py", "--set", "model_type=TOYLM", f"data.total_steps={STEPS}", "data.valid_every=0",
        "model.parallel_output=False", "model.hidden_size=64", "data.seq_len=64", "model.checkpoint=0.5",
        "monitor.log_every=100"]


def _losses(tmp_path, name, nproc, extra=()):
    run = tmp_path / name
    p = run_train(["--run-dir", str(run), *ARGS, *extra], nproc=nproc, script="tests/dist/toy_family.py")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [r["loss"] for r in read_metrics(run)]


def test_toy_family_unknown_until_registered():
    from internlm_core.config import load_config
    with pytest.raises(ConfigError, match=r"model_type: expected one of INTERNLM, INTERNLM2, LLAMA, INTERNLM_MoE, MIXTRAL"):
        load_config("configs/tiny.py", ["model_type=TOYLM"])
    try:
        register()
        assert load_config("configs/tiny.py", ["model_type=toylm"]).model_type == "TOY_MLP"  # alias, any case
    finally:
        unregister_model("TOY_MLP")


def test_toy_family_trains_the_same_under_dp2_and_tp2(tmp_path):
    # one global batch of 4 micro-batches: data parallel ranks take 2 each, tensor parallel ranks all 4
    single = _losses(tmp_path, "one", 1, ["data.micro_num=4"])
    assert len(single) == STEPS and single[-1] < single[0]
    dp2 = _losses(tmp_path, "dp2", 2, ["parallel.zero1=-1", "data.micro_num=2"])
    tp2 = _losses(tmp_path, "tp2", 2, ["parallel.tensor=2", "data.micro_num=4"])
    # fp32; dp2 averages two half-batches' gradients (another summation order), tp2 splits matmuls
    for name, other in (("dp2", dp2), ("tp2", tp2)):
        assert len(other) == STEPS
        for step, (a, b) in enumerate(zip(single, other), 1):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (name, step, a, b)


def test_family_with_its_own_parallel_dimension_trains_the_same(tmp_path):
    """TOY_GROUPED adds the mesh dimension "vg" (`parallel.vocab_groups`): its embedding rows are sharded over
    data-parallel ranks that read different batches. The framework carves the dimension out of the data-parallel
    ranks, FSDP-shards the rest of the model over all of them and the embedding over what remains, and the run
    equals one process (fp32, the same global batch of 4 micro-batches)."""
    grouped = ["model_type=TOY_GROUPED", "parallel.zero1=-1"]
    single = _losses(tmp_path, "one", 1, [*grouped, "data.micro_num=4"])
    assert len(single) == STEPS and single[-1] < single[0]
    vg2 = _losses(tmp_path, "vg2", 2, [*grouped, "parallel.vocab_groups=2", "data.micro_num=2"])
    vg2_dp4 = _losses(tmp_path, "vg2_dp4", 4, [*grouped, "parallel.vocab_groups=2", "data.micro_num=1"])
    for name, other in (("vg2", vg2), ("vg2 of dp4", vg2_dp4)):
        assert len(other) == STEPS
        for step, (a, b) in enumerate(zip(single, other), 1):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (name, step, a, b)


def test_family_dimension_errors_name_the_key():
    from internlm_core.config import load_config
    from internlm_core.distributed import ParallelDims
    from internlm_core.parallel import family_dims
    register()
    try:
        cfg = load_config("configs/tiny.py", ["model_type=TOY_GROUPED", "parallel.vocab_groups=2"])
        assert cfg.parallel.dims == {"vocab_groups": 2}
        spec = cfg.model_inputs()
        from internlm_core.model import get_model_spec
        dims = family_dims(get_model_spec(spec.model_type), cfg.parallel, 4)
        assert dims == (("vg", 2),)
        assert ParallelDims(world_size=4, extra=dims).dp_shard_rest == 2
        with pytest.raises(ConfigError, match=r"parallel dimensions \(vg 2\) must divide the sharded data-parallel "
                                              r"size 1"):
            ParallelDims(world_size=2, tp=2, extra=dims)
        # another family has no such dimension: the key is unknown there
        with pytest.raises(ConfigError, match=r"parallel.vocab_groups"):
            load_config("configs/tiny.py", ["parallel.vocab_groups=2"])
    finally:
        unregister_model("TOY_MLP")
        unregister_model("TOY_GROUPED")
