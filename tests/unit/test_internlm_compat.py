"""InternLM's and InternEvo's config files load as written (tests/fixtures/configs: real files, source in their
headers), every form maps onto ours or is refused in one line, and the run-time semantics users rely on hold:
auto_resume replacing load_ckpt_info, a new learning rate on resume, boto3 URLs with the endpoint in the bucket,
rampup_batch_size, InternLM's dataset types and validation names, hang/spike watching with alerts."""

import sys
from pathlib import Path

import pytest
import torch

from internlm_core.config import build_config, compat, load_config
from internlm_core.config.schema import Config
from internlm_core.config.loader import compat_lines
from internlm_core.errors import ConfigError
from internlm_core.model import build_model, count_parameters

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
ROOT = Path(__file__).resolve().parents[2]

# fixture → (model_type, parameters of the meta build, tensor, sequence parallel); InternEvo's isp mode is context
# parallel of its size here (tests/unit/test_context_config.py), tensor 1
EXPECTED = {
    "internlm_7B_sft.py": ("INTERNLM", 7_321_948_160, 1, False),
    "internlm_20B_sft.py": ("INTERNLM", 20_089_943_040, 8, True),
    "internlm_13B_train_8192_intern.py": ("INTERNLM", 13_745_443_840, 1, False),  # sp="intern": context 8
    "internevo_7B_sft.py": ("INTERNLM", 7_321_948_160, 1, False),
    "internevo_7B_internlm2.py": ("INTERNLM2", 7_737_708_544, 1, False),
    "internevo_7B_isp_sft.py": ("INTERNLM2", 7_321_423_872, 1, False),
    "internevo_7B_llama2.py": ("LLAMA", 7_241_732_096, 1, False),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_internlm_and_internevo_configs_load_as_written(name):
    cfg = load_config(FIXTURES / name)
    model_type, n, tp, sp = EXPECTED[name]
    assert (cfg.model_type, cfg.parallel.tensor, cfg.parallel.sequence_parallel) == (model_type, tp, sp)
    assert count_parameters(build_model(cfg, "meta")) == n
    lines = compat_lines(cfg)
    assert lines and lines[0].startswith("config keys kept for compatibility only") and "embed_split_hidden" in lines[0]


def test_dry_run_lines_and_moe_configs(capsys):
    sys.path.insert(0, str(ROOT))
    import train
    from internlm_core.utils.cli import run_main

    assert train.main(["--config", str(FIXTURES / "internevo_7B_internlm2.py"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "note: config keys kept for compatibility only" in out and "generation" in out
    assert "parallel.tensor.mode='isp'" in out and "built on the meta device: 7,737,708,544" in out
    # InternEvo's MoE config as written: model.top_k moves to moe.top_k, parallel.expert=dict(size=-1, no_tp=False)
    # becomes the expert-parallel size, expert_zero1 / expert_weight are compatibility-only
    assert train.main(["--config", str(FIXTURES / "internevo_7B_MoE4_sft.py"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "model.top_k=2 -> moe.top_k" in out and "parallel.expert_zero1" in out
    # 32 layers: attention 4 * 4096^2, 4 experts of 3 * 4096 * 5632 and a 4-way router each; embedding and output
    per_layer = 4 * 4096 * 4096 + 4 * 3 * 4096 * 5632 + 4 * 4096 + 4 * 4096 + 2 * 4096
    assert f"built on the meta device: {32 * per_layer + 2 * 103168 * 4096 + 4096:,}" in out
    # a dense model_type with experts asked for: one line naming the MoE families
    with pytest.raises(SystemExit) as e:
        run_main(lambda: train.main(["--config", str(FIXTURES / "internevo_7B_MoE4_sft.py"), "--dry-run",
                                     "--set", "model_type=INTERNLM"]))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "model.num_experts=4: model_type 'INTERNLM' is dense; mixture-of-experts needs an MoE model_type " \
           "(INTERNLM_MoE, MIXTRAL, DEEPSEEK_V3, QWEN3_MoE)" in err


def test_forms_map_or_refuse():
    cfg = build_config({"parallel": {"tensor": {"size": 2, "mode": "msp"}}, "model": {"no_bias": True},
                        "monitor": {"tensorboard": {"queue_max_length": 10}}})
    assert cfg.parallel.tensor == 2 and cfg.parallel.sequence_parallel and cfg.model.qkv_bias is False
    assert cfg.monitor.tensorboard is True
    cfg = build_config({"parallel": {"tensor": {"size": 2, "mode": "origin_tp"}}, "model_type": "LLAMA2"})
    assert not cfg.parallel.sequence_parallel and cfg.model_type == "LLAMA"
    for raw, message in [
        ({"parallel": {"tensor": {"size": 1}, "weight": {"size": 2}}},
         r"parallel.weight.size=2: weight parallel needs parallel.tensor.mode='isp'"),
        ({"parallel": {"tensor": {"size": 2, "mode": "xtp"}}}, r"parallel.tensor.mode: expected one of mtp, msp"),
        ({"model": {"num_experts": 4}}, r"model.num_experts=4: model_type 'INTERNLM' is dense"),
        ({"model": {"drop_rate": 0.1}}, r"model.drop_rate=0.1: dropout is not implemented"),
        ({"parallel": {"sequence_2D": {"enable": True}}}, r"2D sequence parallel runs over the isp tensor group"),
        ({"ckpt": {"load_ckpt_folder": "/a", "load_model_only_folder": "/b"}}, r"are both set"),
    ]:
        with pytest.raises(ConfigError, match=message):
            build_config(raw)


def _accepted_value(rule):
    """A value the compatibility key's rule accepts (the rules refuse values that would change the model)."""
    ok = rule[0]
    for value in (1, "normal", True, False, 0):
        try:
            if ok is None or ok(value):
                return value
        except (TypeError, ValueError):
            continue
    raise AssertionError(f"no test value passes {rule}")


def _kept_value(section, home):
    """A value of the schema field `section.home`'s type that differs from its default."""
    default = Config()
    for name in ([section] if section else []) + home.split("."):
        default = getattr(default, name)
    return (not default) if isinstance(default, bool) else default + 1 if isinstance(default, int) else "kept"


def test_every_compatibility_key_is_accepted_noted_and_kept_where_the_schema_has_its_field():
    """One list of compatibility-only keys (compat._COMPAT); the schema's fields marked `compat` are where some of them
    are kept (compat._KEPT, read from the schema): each key loads, is named in the compat log line, and is removed
    or kept in its field. InternLM's zero1.fsdp and pipeline.interleaved_overlap reach zero1_fsdp and
    interleaved_overlap through the same list."""
    assert set(compat._KEPT) <= set(compat._COMPAT)
    assert compat._KEPT[("parallel", "zero1.fsdp")][0] == "zero1_fsdp"
    assert compat._KEPT[("parallel", "pipeline.interleaved_overlap")][0] == "interleaved_overlap"
    for (section, key), rule in compat._COMPAT.items():
        home = compat._KEPT.get((section, key), (None,))[0]
        value = _kept_value(section, home) if home else _accepted_value(rule)
        leaf: dict = {}
        node = leaf
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
        raw = {**leaf} if not section else {section: leaf}
        cfg = build_config(raw)
        name = f"{section}.{key}" if section else key
        assert name in compat_lines(cfg)[0].split(": ", 1)[1].split(", "), name
        if home:
            kept = cfg
            for attr in [section] + home.split("."):
                kept = getattr(kept, attr)
            assert kept == value, name


def test_legacy_checkpoint_keys_as_internlms_legacy_launch():
    ck = build_config({"ckpt": {"load_ckpt_folder": "local:/ck/10", "load_optimizer": False}}).ckpt
    assert ck.load_ckpt_info.path == "/ck/10" and ck.load_ckpt_info.ckpt_type == "internlm"
    assert ck.load_ckpt_info.content == ("model", "sampler") and ck.auto_resume is True
    ck = build_config({"ckpt": {"load_model_only_folder": "/m", "load_given_ckpt": True}}).ckpt
    assert ck.load_ckpt_info.content == ("model",) and ck.auto_resume is False
    ck = build_config({"ckpt": {"load_ckpt_info": {"path": "/x", "content": ["model"], "ckpt_type": "internevo"},
                                "load_ckpt_folder": "/ignored"}}).ckpt
    assert ck.load_ckpt_info.path == "/x" and ck.load_ckpt_info.ckpt_type == "internlm"
    assert build_config({"ckpt": {"save_ckpt_folder": "boto3:s3://w.10.1.2.3/run"}}).ckpt.save_ckpt_folder == \
        "boto3:s3://w.10.1.2.3/run"
    assert build_config({"parallel": {"zero1": 8}}, world_size=2).parallel.zero1 == 2  # InternLM's 7B on 2 ranks


def test_boto3_endpoint_in_bucket_and_internlm_key_variables(monkeypatch):
    boto3 = pytest.importorskip("boto3")
    from internlm_core.checkpoint import parse_destination

    s = parse_destination("boto3:s3://model_weights.10.140.0.1/internlm/snapshot/1/")
    assert (s.bucket, s.prefix, s.endpoint) == ("model_weights", "internlm/snapshot/1", "http://10.140.0.1:80")
    assert s.child("7") == "boto3:s3://model_weights.10.140.0.1/internlm/snapshot/1/7"  # children keep the endpoint
    plain = parse_destination("s3://my.bucket/p")
    assert (plain.bucket, plain.endpoint) == ("my.bucket", None)
    seen = {}
    monkeypatch.setattr(boto3, "client", lambda *a, **kw: seen.update(kw) or object())
    monkeypatch.setenv("S3_ACCESS_KEY_ID", "AK")
    monkeypatch.setenv("S3_SECRET_ACCESS_KEY_ID", "SK")
    s.client
    assert (seen["endpoint_url"], seen["aws_access_key_id"], seen["aws_secret_access_key"]) == \
        ("http://10.140.0.1:80", "AK", "SK")


def test_new_learning_rate_replaces_the_checkpoints(caplog):
    from internlm_core.optim import WarmupCosineLR

    def sched(lr):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)
        return WarmupCosineLR(opt, total_steps=100, warmup_ratio=0.1, eta_min=1e-5), opt

    old, _ = sched(3e-3)
    for _ in range(10):
        old.step()
    new, opt = sched(1e-4)
    with caplog.at_level("WARNING"):
        new.load_state_dict(old.state_dict())
    assert "Using new learning rate 0.0001 to replace old learn rate 0.003." in caplog.text
    new.step()  # step 11: on the cosine of the new peak, as a fresh 1e-4 schedule is
    ref, _ = sched(1e-4)
    for _ in range(11):
        ref.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(ref.get_last_lr()[0]) and opt.param_groups[0]["lr"] < 1e-4


def test_hang_and_spike_watching_follow_alerts(tmp_path):
    from internlm_core.monitor import build_loss_health, build_watchdog
    from internlm_core.monitor.alert import AlertManager, FileSink

    mon = build_config({}).monitor
    assert mon.hang_timeout is None and build_watchdog(mon, None) is None
    on = AlertManager([FileSink(tmp_path / "alerts.jsonl")])
    try:
        assert build_watchdog(mon, on).timeout == 300.0 and build_loss_health(mon, on).spike_ratio == 1.5
        assert build_loss_health(mon, None).spike_ratio == 0.0
        assert build_watchdog(build_config({"monitor": {"hang_timeout": 0}}).monitor, on) is None
    finally:
        on.close(timeout=1)


# ---- data -------------------------------------------------------------------------------------------------------

def _write(path, docs):
    from internlm_core.data.formats import OursWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    w = OursWriter(str(path), str(path) + ".meta", 100)
    for d in docs:
        w.write(d)
    w.close()


def data_cfg(**kw):
    base = {"seq_len": 8, "micro_num": 4, "micro_bsz": 1, "min_length": 0}
    return build_config({"data": {**base, **kw}}).data


def test_rampup_batch_size_as_internlms_sampler(tmp_path):
    from internlm_core.data import build_train_loader

    _write(tmp_path / "train" / "en" / "a.bin", [list(range(1, 9))] * 200)
    cfg = data_cfg(train_folder=str(tmp_path / "train"), rampup_batch_size="1 1 2")
    sizes = []
    ld = build_train_loader(cfg, dp_rank=0, dp_size=2, vocab_size=100)
    it = iter(ld)
    for _ in range(9):
        sizes.append(next(it)["input_ids"].shape[0])
    assert sizes == [1, 1, 2, 2, 3, 3, 4, 4, 4]  # start 1, +1 every 2 steps, up to micro_num 4
    again = build_train_loader(cfg, dp_rank=1, dp_size=2, vocab_size=100)
    again.load_state_dict(ld.state_dict())  # resume after 9 steps: full steps, no row repeated or skipped
    assert ld.consumed == 2 * sum(sizes) and next(iter(again))["input_ids"].shape[0] == 4
    with pytest.raises(ConfigError, match=r"data.rampup_batch_size '8 1 2': expected 1 <= start <= data.micro_num"):
        data_cfg(rampup_batch_size="8 1 2")


def test_internlm_types_by_whole_path_and_validation_names(tmp_path):
    from internlm_core.data import build_train_loader, build_valid_loaders

    _write(tmp_path / "data" / "en" / "a.bin", [[1, 2, 3, 4, 5]] * 40)  # train_folder is itself .../en
    ld = build_train_loader(data_cfg(train_folder=str(tmp_path / "data" / "en"), dataset_type_mode="internlm"),
                            dp_rank=0, dp_size=1, vocab_size=100)
    assert set(next(iter(ld))["type_ids"].unique().tolist()) == {0}
    _write(tmp_path / "valid" / "en" / "wiki" / "v.bin", [[1, 2]] * 3)  # short documents are validated too
    _write(tmp_path / "valid" / "cn" / "news" / "w.bin", [[3, 4, 5]] * 2)
    cfg = data_cfg(train_folder=str(tmp_path / "data" / "en"), valid_folder=str(tmp_path / "valid"),
                   dataset_type_mode="internlm", min_length=50, valid_micro_num=1)
    valid = build_valid_loaders(cfg, dp_rank=0, dp_size=1, vocab_size=100)
    assert sorted(valid) == ["news", "wiki"]  # InternLM: each folder holding .bin files, by its own name
    tokens = sum(int((b["labels"] != -100).sum()) for b in valid["wiki"])
    assert tokens == 3 * 1  # three 2-token documents, one prediction each, despite min_length=50


def test_zero_bubble_maps_to_a_zero_bubble_schedule_or_is_refused():
    """InternEvo's pipeline.zero_bubble=True (once silently plain 1F1B, issue 38 item 1): its ZB-H1 (one chunk) runs
    torch's interleaved_zb, its ZB-V (two chunks) zbv, each said in the compat log line; with model.compile, or
    against another explicit schedule, refused in one line naming why; pipeline size 1 has nothing to schedule."""
    base = {"num_layers": 4}
    for chunks, name in ((1, "interleaved_zb"), (2, "zbv")):
        cfg = build_config({"model": {**base, "num_chunks": chunks}, "data": {"micro_num": 4},
                            "parallel": {"pipeline": {"size": 2, "zero_bubble": True}}})
        assert cfg.parallel.pipeline_schedule == name
        assert f"parallel.pipeline.zero_bubble=True -> parallel.pipeline_schedule={name!r}" in compat_lines(cfg)[-1]
    with pytest.raises(ConfigError) as err:
        build_config({"model": {**base, "compile": True}, "data": {"micro_num": 4},
                      "parallel": {"pipeline": {"size": 2, "zero_bubble": True}}})
    assert str(err.value).startswith("config: parallel.pipeline_schedule='interleaved_zb' (from "
                                     "parallel.pipeline.zero_bubble=True) with model.compile=True: the compiled "
                                     "blocks' backward is one graph")  # the key the user wrote named too
    with pytest.raises(ConfigError, match=r"zero_bubble=True maps to parallel.pipeline_schedule='interleaved_zb', but "
                                          r"parallel.pipeline_schedule='1f1b' is set"):
        build_config({"model": base, "data": {"micro_num": 4},
                      "parallel": {"pipeline": {"size": 2, "zero_bubble": True}, "pipeline_schedule": "1f1b"}})
    with pytest.raises(ConfigError, match=r"run model.num_chunks 1 \(ZB-H1\) or 2 \(ZB-V\), got 4"):
        build_config({"model": {**base, "num_chunks": 4}, "data": {"micro_num": 4},
                      "parallel": {"pipeline": {"size": 1 + 1, "zero_bubble": True}}})
    cfg = build_config({"parallel": {"pipeline": {"size": 1, "zero_bubble": True}}})
    assert cfg.parallel.pipeline_schedule == "auto"
    assert "zero_bubble=True with pipeline size 1: no pipeline to schedule" in " ".join(compat_lines(cfg))
