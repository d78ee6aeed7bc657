"""Config loading: InternLM's format and defaults, overrides, YAML, and one clear error per mistake."""

import textwrap

import pytest
import yaml

from internlm_core.config import build_config, dump_yaml, load_config
from internlm_core.errors import ConfigError

SEVEN_B = "configs/7B.py"


def test_7b_defaults_are_internlm_semantics():
    cfg = load_config(SEVEN_B)
    assert cfg.JOB_NAME == "7b_train"
    assert cfg.data.packed_length == 2048 * 2  # seq_len * micro_bsz
    assert cfg.data.valid_micro_num == 4
    assert cfg.parallel.zero1 == 8 and cfg.parallel.pipeline == 1 and cfg.parallel.interleaved_overlap is True
    assert cfg.grad_scaler.initial_scale == 2**16 and cfg.grad_scaler.hysteresis == 2
    assert cfg.lr_scheduler.total_steps == 50000
    assert cfg.beta2_scheduler.init_beta2 == 0.95
    assert cfg.model.qkv_bias is True and cfg.model.num_kv_attention_heads == 32
    assert cfg.ckpt.save_ckpt_folder == "llm_ckpts"  # "local:" prefix removed


def test_packed_length_follows_overridden_seq_len():
    cfg = build_config({"data": {"seq_len": 128, "micro_bsz": 3, "micro_num": 5}})
    assert cfg.data.packed_length == 384 and cfg.data.valid_micro_num == 5


def test_overrides_any_key():
    cfg = load_config(SEVEN_B, ["data.total_steps=20", "model.num_layers=2", "model.dtype=torch.float32",
                                "ckpt.load_ckpt_info={'path': '/x', 'content': ['model']}"])
    assert cfg.data.total_steps == 20 and cfg.model.num_layers == 2 and cfg.model.dtype == "torch.float32"
    assert cfg.lr_scheduler.total_steps == 20  # derived after the override
    assert cfg.ckpt.load_ckpt_info.path == "/x" and cfg.ckpt.load_ckpt_info.content == ("model",)


def test_yaml_round_trip(tmp_path):
    cfg = load_config(SEVEN_B, ["data.total_steps=7"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_yaml(cfg))
    again = load_config(path)
    assert again == cfg
    assert yaml.safe_load(path.read_text())["data"]["total_steps"] == 7


def test_unknown_key_names_closest():
    with pytest.raises(ConfigError) as e:
        load_config(SEVEN_B, ["data.seq_lenn=3"])
    assert str(e.value) == "configs/7B.py: unknown config key 'data.seq_lenn'; did you mean 'data.seq_len'?"


def test_unknown_section_names_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'lr_schedular'; did you mean 'lr_scheduler'\?"):
        build_config({"lr_schedular": {}})


def test_wrong_type_names_key_value_and_type():
    with pytest.raises(ConfigError) as e:
        load_config(SEVEN_B, ["data.seq_len='abc'"])
    assert str(e.value) == "configs/7B.py: data.seq_len: expected int, got 'abc'"
    with pytest.raises(ConfigError, match=r"model.checkpoint: expected True, False, \"full\", \"selective\" or a fraction in \[0, 1\], got 'yes'"):
        build_config({"model": {"checkpoint": "yes"}})


@pytest.mark.parametrize("raw,world,message", [
    ({"model": {"hidden_size": 100, "num_attention_heads": 3}}, None,
     r"model.num_attention_heads \(3\) must divide model.hidden_size \(100\)"),
    ({"model": {"num_attention_heads": 8, "num_kv_attention_heads": 3}, "model_type": "LLAMA"}, None,
     r"num_kv_attention_heads \(3\) must divide model.num_attention_heads \(8\)"),
    ({"parallel": {"tensor": 2, "pipeline": 2}, "data": {"micro_num": 2}}, 6,
     r"world size 6 is not divisible by parallel.tensor \* parallel.pipeline \(2 \* 2 = 4\)"),
    ({"parallel": {"zero1": 3}}, 4, r"parallel.zero1 \(3\) must divide the data-parallel size \(4"),
    ({"data": {"packed_length": 100}}, None, r"data.packed_length \(100\) must equal data.seq_len \* data.micro_bsz"),
    ({"model_type": "INTERNLM3"}, None, r"model_type: expected one of INTERNLM, INTERNLM2, LLAMA, INTERNLM_MoE, MIXTRAL"),
    ({"model": {"dtype": "torch.float8"}}, None, r"model.dtype: expected one of"),
    ({"ckpt": {"enable_save_ckpt": True}}, None, r"ckpt.save_ckpt_folder: must be set"),
])
def test_inconsistent_values_say_which_and_why(raw, world, message):
    with pytest.raises(ConfigError, match=message):
        build_config(raw, world_size=world)


def test_python_config_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("data = dict(\n  seq_len=2048,\n  micro_num=4\n  micro_bsz=2)\n")
    with pytest.raises(ConfigError, match=r"bad.py line \d+: syntax error"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"config file not found"):
        load_config(tmp_path / "missing.py")


def test_all_caps_constants_are_ignored_but_lowercase_unknown_is_not(tmp_path):
    f = tmp_path / "c.py"
    f.write_text(textwrap.dedent("""
        SEQ_LEN = 64
        data = dict(seq_len=SEQ_LEN)
        model_typ = "LLAMA"
    """))
    with pytest.raises(ConfigError, match=r"unknown config key 'model_typ'; did you mean 'model_type'\?"):
        load_config(f)


def test_internlm_alternative_forms():
    cfg = build_config({"parallel": {"zero1": {"size": -1, "fsdp": True}, "tensor": {"size": 2, "mode": "mtp"},
                                     "pipeline": {"size": 1, "interleaved_overlap": False}},
                        "model": {"num_attention_heads": 32, "dtype": "torch.half"}})
    assert cfg.parallel.zero1 == -1 and cfg.parallel.zero1_fsdp is True and cfg.parallel.tensor == 2
    assert cfg.parallel.interleaved_overlap is False and cfg.model.dtype == "torch.float16"


def test_override_syntax_error():
    with pytest.raises(ConfigError, match=r"--set 'data.total_steps': expected KEY=VALUE"):
        load_config(SEVEN_B, ["data.total_steps"])


def test_checkpoint_names_are_one_list_shared_with_the_checkpoint_package():
    """load_ckpt_info's contents and types live in config/ckpt_names.py; the checkpoint package saves under those
    contents and has a loader for exactly the foreign types the config accepts (no other, none missing)."""
    from internlm_core.checkpoint import CONTENTS, FOREIGN_LOADERS, normalize_content
    from internlm_core.config import ckpt_names

    assert CONTENTS is ckpt_names.CONTENTS
    assert normalize_content("all") == ckpt_names.CONTENTS
    assert set(FOREIGN_LOADERS) == set(ckpt_names.FOREIGN_CKPT_TYPES)
    assert set(ckpt_names.CKPT_TYPES) == {ckpt_names.OWN_CKPT_TYPE, *FOREIGN_LOADERS}
    assert set(ckpt_names.CKPT_TYPE_ALIASES.values()) <= set(ckpt_names.CKPT_TYPES)
    for kind in (*ckpt_names.CKPT_TYPES, *ckpt_names.CKPT_TYPE_ALIASES):  # every name the config accepts can load
        info = build_config({"ckpt": {"load_ckpt_info": {"path": "/x", "ckpt_type": kind}}}).ckpt.load_ckpt_info
        assert info.ckpt_type == ckpt_names.OWN_CKPT_TYPE or info.ckpt_type in FOREIGN_LOADERS
    with pytest.raises(ConfigError, match=r"ckpt_type: expected one of internlm_core, internlm, hf, hf_llama, llama \(or "):
        build_config({"ckpt": {"load_ckpt_info": {"path": "/x", "ckpt_type": "megatron"}}})
    with pytest.raises(ConfigError, match=r"content: unknown \['rng'\]; expected any of model, sampler, optimizer, "
                                          r"scheduler, all$"):
        build_config({"ckpt": {"load_ckpt_info": {"path": "/x", "content": ["model", "rng"]}}})


def test_zero1_larger_than_data_parallel_is_normalized_before_the_checks():
    """InternLM's zero1=8 on 2 data-parallel ranks shards over both (noted); check_consistency itself only checks."""
    from internlm_core.config.loader import check_consistency, compat_lines

    cfg = build_config({"parallel": {"zero1": 8}}, world_size=2)
    assert cfg.parallel.zero1 == 2
    assert "parallel.zero1=8 > data-parallel size 2: sharding over all 2" in compat_lines(cfg)[-1]
    cfg = build_config({"parallel": {"zero1": 8}})
    check_consistency(cfg, world_size=16)  # 8 divides 16: nothing to say, nothing changed
    assert cfg.parallel.zero1 == 8
    with pytest.raises(ConfigError, match=r"parallel.zero1 \(8\) must divide the data-parallel size \(2 = world size 2"):
        check_consistency(cfg, world_size=2)
    assert cfg.parallel.zero1 == 8
