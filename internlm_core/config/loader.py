"""Load a Python or YAML config, apply `--set` overrides, fill InternLM's defaults, validate.

The result is a typed `Config`; every problem is one `ConfigError` that names the key (and file).
"""

from __future__ import annotations

import dataclasses
import difflib
import runpy
import typing
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from ..errors import ConfigError
from ..model.spec import get_model_spec
from ..utils.redact import drop_redacted, redact_tree, register_tree
from .ckpt_names import CKPT_TYPE_ALIASES, CKPT_TYPES, CONTENTS
from .fp8 import fp8_plan
from .mtp import check_mtp
from .recompute import checkpoint_plan, fused_head_of
from .compat import normalize
from .context import check_context
from .fault_tolerance import check_fault_tolerance
from .overrides import apply_overrides, parse_overrides
from .pipeline import check_pipeline_schedule, check_split_backward
from .hf_folder import adopt_hf_folder, explicit_keys
from .schema import TRACKERS, Config, DataConfig, LoadCkptInfo

_DTYPES = {
    "torch.float32": "torch.float32", "float32": "torch.float32", "fp32": "torch.float32", "torch.float": "torch.float32",
    "torch.tf32": "torch.tf32", "tf32": "torch.tf32",
    "torch.bfloat16": "torch.bfloat16", "bfloat16": "torch.bfloat16", "bf16": "torch.bfloat16",
    "torch.float16": "torch.float16", "float16": "torch.float16", "fp16": "torch.float16", "torch.half": "torch.float16",
}


def read_config_file(path: str | Path) -> dict:
    """The raw dict of a `.py` (its top-level names) or `.yaml`/`.yml`/`.json` config file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    if path.suffix in (".yaml", ".yml", ".json"):
        try:
            raw = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of config sections at the top level")
        return raw
    if path.suffix != ".py":
        raise ConfigError(f"{path}: expected a .py, .yaml or .yml config file")
    try:
        ns = runpy.run_path(str(path))
    except SyntaxError as e:
        raise ConfigError(f"{path} line {e.lineno}: syntax error ({e.msg})") from None
    except Exception as e:  # the file is user code: report where it failed, not our stack
        raise ConfigError(f"{path}: executing the config failed: {type(e).__name__}: {e}") from None
    return {k: v for k, v in ns.items() if not k.startswith("_") and not callable(v)
            and not isinstance(v, type(typing)) and not isinstance(v, type)}


def strip_location_prefix(location: str) -> str:
    """A checkpoint location without InternLM's `local:` / `boto3:` prefixes: a plain path or an s3:// URL."""
    for prefix in ("local:", "boto3:"):
        if location.startswith(prefix):
            location = location[len(prefix):]
    return location


def _closest(name: str, candidates: Iterable[str]) -> str:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else ""


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        names = " or ".join(_type_name(a) for a in args)
        return names + (" or None" if len(args) < len(typing.get_args(tp)) else "")
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp` (with the usual safe coercions)."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a section (dict) of {tp.__name__}, got {value!r}")
        return _build(tp, value, key)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected bool, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected int, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected float, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected str, got {value!r}")
    if tp is tuple:
        if isinstance(value, str):
            return (value,)
        if isinstance(value, (list, tuple)):
            return tuple(value)
        raise ConfigError(f"{key}: expected a tuple or list, got {value!r}")
    return value


def _build(cls: type, raw: Mapping, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {fl.name for fl in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in raw.items():
        key = f"{prefix}.{k}" if prefix else k
        if k not in names:
            hint = _closest(k, names)
            if hint and prefix:
                hint = hint.replace("mean '", f"mean '{prefix}.")
            raise ConfigError(f"unknown config key {key!r}{hint}")
        kwargs[k] = _convert(v, hints[k], key)
    return cls(**kwargs)


def _is_file_constant(name: str) -> bool:
    """ALL_CAPS names in a Python config are the file's own constants (SEQ_LEN, HIDDEN_SIZE, ...)."""
    return name.isupper() and name not in ("JOB_NAME", "DO_ALERT")


def build_config(raw: dict, source: str = "config", world_size: int | None = None) -> Config:
    """Validate a raw dict into a `Config`, fill derived defaults and check consistency. Its secrets are registered
    for redaction (utils/redact.py); a `<redacted>` value (a config file a run wrote) counts as unset."""
    raw = drop_redacted({k: v for k, v in raw.items() if not _is_file_constant(k)})
    register_tree(raw)
    try:
        raw, notes = normalize(raw)  # InternLM's and InternEvo's forms (compat.py)
        raw = _collect_family_dims(raw)
        cfg = _build(Config, raw, "")
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    cfg.compat_notes = notes
    try:
        fill_defaults(cfg)
        adopt_hf_folder(cfg, explicit_keys(raw))  # a Hugging Face folder to load defines the model
        fit_zero1_to_world(cfg, world_size)
        check_consistency(cfg, world_size)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return cfg


def _collect_family_dims(raw: dict) -> dict:
    """`parallel.<key>` of a dimension the model family adds (its plan's mesh_dims) moves into `parallel.dims`,
    where the schema keeps them; any other unknown key stays and is reported by validation."""
    parallel = raw.get("parallel")
    if not isinstance(parallel, dict):
        return raw
    try:
        spec = get_model_spec(raw.get("model_type", Config.model_type))
    except ConfigError:
        return raw  # an unknown model_type is reported with its own message
    keys = {d.key for d in spec.plan.mesh_dims} & set(parallel)
    if not keys:
        return raw
    dims = dict(parallel.get("dims") or {})
    dims.update({k: parallel[k] for k in keys})
    parallel = {k: v for k, v in parallel.items() if k not in keys}
    return {**raw, "parallel": {**parallel, "dims": dims}}


def compat_lines(cfg: Config) -> list[str]:
    """The log lines saying which keys of the loaded file were kept for compatibility only, and which InternLM
    forms were translated (empty for a config in our own terms)."""
    return cfg.compat_notes.lines() if cfg.compat_notes is not None else []


def fill_defaults(cfg: Config) -> None:
    """InternLM's derived defaults (packed_length, valid_micro_num, schedules from adam/data, ...)."""
    d, m = cfg.data, cfg.model
    if d.packed_length is None:
        d.packed_length = d.seq_len * d.micro_bsz
    if d.valid_micro_num is None:
        d.valid_micro_num = d.micro_num
    if d.seed is None:
        d.seed = cfg.seed
    m.dtype = _DTYPES.get(str(m.dtype), m.dtype)
    spec = get_model_spec(cfg.model_type)  # the family's canonical name; its own defaults
    cfg.model_type = spec.name
    if m.num_kv_attention_heads is None:
        m.num_kv_attention_heads = m.num_attention_heads
    spec.fill_defaults(m)
    if cfg.use_fp32_norm:
        m.use_fp32_norm = True
    if cfg.lr_scheduler.total_steps is None:
        cfg.lr_scheduler.total_steps = d.total_steps
    if cfg.beta2_scheduler.init_beta2 is None:
        cfg.beta2_scheduler.init_beta2 = cfg.adam.adam_beta2
    if cfg.beta2_scheduler.c is None:
        cfg.beta2_scheduler.c = cfg.adam.adam_beta2_c
    if cfg.DO_ALERT:
        cfg.monitor.alert.enable_feishu_alert = True
    info = cfg.ckpt.load_ckpt_info
    if info is not None and isinstance(info, LoadCkptInfo):
        info.content = tuple(c.lower() for c in info.content)
        kind = str(info.ckpt_type).lower()
        info.ckpt_type = CKPT_TYPE_ALIASES.get(kind, kind)



def check_rampup(spec: str, micro_num: int, pipeline: int, data_type: str = "tokenized") -> None:
    """InternLM's rampup_batch_size "start increment every": micro-batches per step start at `start` and grow by
    `increment` every `every` steps up to data.micro_num."""
    try:
        start, inc, every = (int(x) for x in str(spec).split())
    except ValueError:
        raise ConfigError(f"data.rampup_batch_size: expected three integers \"start increment every\" (e.g. "
                          f"\"2 1 10\"), got {spec!r}") from None
    if not (1 <= start <= micro_num and inc >= 1 and every >= 1):
        raise ConfigError(f"data.rampup_batch_size {spec!r}: expected 1 <= start <= data.micro_num ({micro_num}), "
                          f"increment >= 1 and every >= 1")
    if pipeline > 1:
        raise ConfigError("data.rampup_batch_size: not supported with parallel.pipeline > 1 (the pipeline schedule "
                          "has a fixed number of micro-batches)")
    if data_type == "streaming":
        raise ConfigError("data.rampup_batch_size: not supported with data.type='streaming'")


def fit_zero1_to_world(cfg: Config, world_size: int | None) -> None:
    """Lower parallel.zero1 to the data-parallel size when it is larger (InternLM's 7B config says zero1=8: on fewer
    data-parallel ranks it shards over all of them), with a note in the compat log line. A normalization, run before
    the checks so that they only check; a layout the world size cannot hold is left for them to report."""
    p = cfg.parallel
    split = p.tensor * p.pipeline * p.context.size
    if world_size is None or min(p.tensor, p.pipeline, p.context.size) < 1 or world_size % split:
        return
    dp = world_size // split
    if p.zero1 > dp:
        if cfg.compat_notes is not None:
            cfg.compat_notes.mapped.append(f"parallel.zero1={p.zero1} > data-parallel size {dp}: sharding over all {dp}")
        p.zero1 = dp


def check_consistency(cfg: Config, world_size: int | None = None) -> None:
    """Values that are each valid but wrong together (checks only: `fill_defaults` and `fit_zero1_to_world` have
    normalized the config already)."""
    _check_positive(cfg)
    _check_data(cfg.data, cfg.parallel.pipeline)
    _check_choices(cfg)
    _check_ckpt(cfg)
    _check_layout(cfg, world_size)
    check_fault_tolerance(cfg.parallel.fault_tolerance, cfg.monitor)
    get_model_spec(cfg.model_type).validate(cfg.model_inputs())  # the family's own rules (heads, norms, its plan)


def _check_positive(cfg: Config) -> None:
    """Counts and sizes that must be at least 1 (checked first: the other checks divide by some of them)."""
    d, m, p = cfg.data, cfg.model, cfg.parallel
    positive = {"data.seq_len": d.seq_len, "data.micro_num": d.micro_num, "data.micro_bsz": d.micro_bsz,
                "data.total_steps": d.total_steps, "model.num_layers": m.num_layers, "model.hidden_size": m.hidden_size,
                "model.num_attention_heads": m.num_attention_heads, "model.vocab_size": m.vocab_size,
                "parallel.tensor": p.tensor, "parallel.pipeline": p.pipeline, "model.num_chunks": m.num_chunks,
                "data.valid_micro_num": d.valid_micro_num}
    for key, v in positive.items():
        if v < 1:
            raise ConfigError(f"{key}: expected a positive integer, got {v}")


def _check_data(d: DataConfig, pipeline: int) -> None:
    """The data section: the packed row's length, the ramp-up, the kind of data and what it needs, the mixture."""
    if d.packed_length != d.seq_len * d.micro_bsz:
        raise ConfigError(f"data.packed_length ({d.packed_length}) must equal data.seq_len * data.micro_bsz "
                          f"({d.seq_len} * {d.micro_bsz} = {d.seq_len * d.micro_bsz})")
    if d.rampup_batch_size:
        check_rampup(d.rampup_batch_size, d.micro_num, pipeline, d.type)
    if d.dummy_distribution not in ("uniform", "zipf"):
        raise ConfigError(f"data.dummy_distribution: expected 'uniform' or 'zipf', got {d.dummy_distribution!r}")
    if d.dataset_type_mode not in ("subfolder", "internlm"):
        raise ConfigError(f"data.dataset_type_mode: expected 'subfolder' or 'internlm', got {d.dataset_type_mode!r}")
    if d.type not in ("tokenized", "streaming", "megatron"):
        raise ConfigError(f"data.type: expected 'tokenized', 'streaming' or 'megatron', got {d.type!r}")
    if d.type == "streaming" and (d.train_folder is None or not d.tokenizer_path):
        raise ConfigError("data.type='streaming' needs data.train_folder (jsonl, parquet or Hugging Face datasets "
                          "folders) and data.tokenizer_path (e.g. 'byte' or a tokenizer.json)")
    if d.dataset_weights is not None:
        if not isinstance(d.dataset_weights, Mapping) or not d.dataset_weights:
            raise ConfigError(f"data.dataset_weights: expected a dict {{dataset type: weight}}, got {d.dataset_weights!r}")
        for k, v in d.dataset_weights.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v == float("inf"):
                raise ConfigError(f"data.dataset_weights[{k!r}]: expected a weight > 0, got {v!r}")


def _check_choices(cfg: Config) -> None:
    """Keys outside the data section that take one of a few values, or a fraction."""
    m = cfg.model
    if m.dtype not in set(_DTYPES.values()):
        raise ConfigError(f"model.dtype: expected one of torch.float32, torch.tf32, torch.bfloat16, torch.float16, "
                          f"got {m.dtype!r}")
    checkpoint_plan(m.checkpoint)  # True, False, "full", "selective" or a fraction; ConfigError naming the key
    fused_head_of(cfg)  # model.fused_head_loss: True, False or "auto"; True refused where it cannot run
    check_mtp(m, cfg.parallel.tensor)  # model.mtp: its value, and tensor parallel refused
    fp8_plan(m.fp8)  # model.fp8: off, a torchao recipe name or torchtitan's float8 dict; ConfigError naming the key
    if cfg.adam.fused not in ("auto", "torch", "apex"):
        raise ConfigError(f"adam.fused: expected auto, torch or apex, got {cfg.adam.fused!r}")
    if m.attn_backend not in ("auto", "flash", "torch_varlen", "sdpa", "cpu_blocked"):
        raise ConfigError(f"model.attn_backend: expected auto, flash, torch_varlen, sdpa or cpu_blocked, "
                          f"got {m.attn_backend!r}")
    if not 0.0 <= cfg.lr_scheduler.warmup_ratio <= 1.0:
        raise ConfigError(f"lr_scheduler.warmup_ratio: expected a fraction in [0, 1], got {cfg.lr_scheduler.warmup_ratio}")
    if not 0.0 <= cfg.loss.label_smoothing < 1.0:
        raise ConfigError(f"loss.label_smoothing: expected a value in [0, 1), got {cfg.loss.label_smoothing}")
    if cfg.loss.reduction not in ("token_mean", "micro_batch_mean"):
        raise ConfigError(f"loss.reduction: expected token_mean or micro_batch_mean, got {cfg.loss.reduction!r}")
    bad = [t for t in cfg.monitor.trackers if t not in TRACKERS]
    if bad:
        raise ConfigError(f"monitor.trackers: unknown {bad}; expected any of {', '.join(TRACKERS)}")


def _check_ckpt(cfg: Config) -> None:
    """The checkpoint section: what to load (the names of ckpt_names.py, which the checkpoint package uses too)
    and where and how often to save."""
    info = cfg.ckpt.load_ckpt_info
    if info is not None:
        bad = [c for c in info.content if c not in (*CONTENTS, "all")]
        if bad:
            raise ConfigError(f"ckpt.load_ckpt_info.content: unknown {bad}; expected any of "
                              f"{', '.join((*CONTENTS, 'all'))}")
        if info.ckpt_type not in CKPT_TYPES:
            raise ConfigError(f"ckpt.load_ckpt_info.ckpt_type: expected one of {', '.join(CKPT_TYPES)} (or "
                              f"{', '.join(sorted(CKPT_TYPE_ALIASES))}), got {info.ckpt_type!r}")
    if cfg.ckpt.enable_save_ckpt and not cfg.ckpt.save_ckpt_folder:
        raise ConfigError("ckpt.save_ckpt_folder: must be set when ckpt.enable_save_ckpt is True")
    if cfg.ckpt.checkpoint_every < 1:
        raise ConfigError(f"ckpt.checkpoint_every: expected a positive integer, got {cfg.ckpt.checkpoint_every}")


def _check_layout(cfg: Config, world_size: int | None) -> None:
    """The parallel layout against the model's shape and the batch, then (when known) against the world size."""
    d, m, p = cfg.data, cfg.model, cfg.parallel
    if p.pipeline == 1 and m.num_chunks != 1:
        raise ConfigError(f"model.num_chunks ({m.num_chunks}) > 1 needs parallel.pipeline > 1 (interleaved schedule)")
    if p.pipeline > 1 and m.num_layers % (p.pipeline * m.num_chunks):
        raise ConfigError(f"model.num_layers ({m.num_layers}) must be divisible by parallel.pipeline * model.num_chunks "
                          f"({p.pipeline} * {m.num_chunks}) to split the layers into pipeline stages")
    if p.pipeline > 1 and d.micro_num < p.pipeline:
        raise ConfigError(f"data.micro_num ({d.micro_num}) must be at least parallel.pipeline ({p.pipeline}) "
                          f"to keep every stage busy")
    origins = cfg.compat_notes.origins if cfg.compat_notes is not None else {}
    schedule = check_pipeline_schedule(p.pipeline_schedule, p.pipeline, m.num_chunks, d.micro_num, m.compile,
                                       origins.get("parallel.pipeline_schedule", ""))
    if p.pipeline > 1:
        check_split_backward(schedule, checkpoint_plan(m.checkpoint)[0])
    ring = p.context.size > 1 and (p.context.mode == "ring" or (p.context.mode == "2d" and p.context.inner < p.context.size))
    if ring and checkpoint_plan(m.checkpoint)[0] == "selective":  # found by issue 38's held-out checks, cause open
        raise ConfigError(f"model.checkpoint='selective' with context parallel's ring (parallel.context mode "
                          f"{p.context.mode!r}): the first step hangs (measured: INTERNLM and QWEN3_MoE at context 2); "
                          f"use model.checkpoint=True (or a fraction) or parallel.context.mode='all_to_all'")
    if p.tensor > 1 and m.vocab_size % p.tensor:
        raise ConfigError(f"parallel.tensor ({p.tensor}) must divide model.vocab_size ({m.vocab_size}) "
                          f"for the vocabulary-parallel embedding and output")
    if p.sequence_parallel and p.tensor == 1:
        raise ConfigError("parallel.sequence_parallel: needs parallel.tensor > 1")
    check_context(cfg, world_size)
    if world_size is None:
        return
    tp_pp = p.tensor * p.pipeline
    if world_size % tp_pp:
        raise ConfigError(f"world size {world_size} is not divisible by parallel.tensor * parallel.pipeline "
                          f"({p.tensor} * {p.pipeline} = {tp_pp})")
    dp = world_size // (tp_pp * p.context.size)
    if p.zero1 > 1 and dp % p.zero1:
        raise ConfigError(f"parallel.zero1 ({p.zero1}) must divide the data-parallel size ({dp} = world size "
                          f"{world_size} / (tensor {p.tensor} * pipeline {p.pipeline}"
                          + (f" * context {p.context.size}))" if p.context.size > 1 else "))"))


def load_config(path: str | Path, overrides: Iterable[str] = (), world_size: int | None = None) -> Config:
    """Read, override, validate: the one entry point of the config package."""
    raw = read_config_file(path)
    raw = apply_overrides(raw, parse_overrides(overrides))
    return build_config(raw, source=str(path), world_size=world_size)


def config_to_dict(cfg: Config) -> dict:
    """Plain dict of a Config (tuples as lists), ready for YAML or JSON."""
    def plain(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x
    return plain(dataclasses.asdict(cfg))


def dump_yaml(cfg: Config) -> str:
    """The resolved config as YAML, loadable again by `load_config`, with its secrets redacted (utils/redact.py):
    the text goes into files (the run folder's config.yaml, every checkpoint's meta.json and config.yaml)."""
    return yaml.safe_dump(redact_tree(config_to_dict(cfg)), sort_keys=False)
