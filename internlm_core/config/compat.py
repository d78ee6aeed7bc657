"""InternLM's and InternEvo's config forms, mapped onto the schema before it is validated.

Users bring config files of InternLM (InternLM/InternLM at aaaf4d7 and its develop branch) and of InternEvo. Every
key of those files either maps onto one of ours (`parallel.tensor=dict(size, mode)` onto tensor and sequence
parallel, `model.no_bias` onto `model.qkv_bias`, the legacy `ckpt.load_ckpt_folder` onto `load_ckpt_info`, ...),
is kept for compatibility only (listed in one log line at start: nothing is ignored silently), or names a feature
this framework does not have (dropout, ...): then one ConfigError says so. Context parallel's forms (InternEvo's
isp tensor mode and sequence_2D) are context.py's, the MoE keys moe_compat.py's.

    raw, notes = normalize(raw)        # notes.compat: keys without effect; notes.mapped: forms that were translated
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..errors import ConfigError
from .context import context_forms
from .moe_compat import moe_forms
from .mtp import mtp_forms
from .pipeline import zero_bubble_schedule
from .schema import Config

# InternEvo's parallel.tensor modes and InternLM develop's spellings of them → (sequence parallel, what it means)
_TENSOR_MODES = {
    "mtp": False, "origin_tp": False, "none": False,
    "msp": True, "megatron": True,
    "fsp": True, "fstp": True, "flash-attn": True,
    "isp": True, "intern": True,
}
_ISP = ("isp", "intern")
_SP_SPELLINGS = {"none": "mtp", "megatron": "msp", "flash-attn": "fsp", "intern": "isp"}  # develop's tensor.sp



@dataclass
class CompatNotes:
    """What normalize() did: keys kept for compatibility only, and InternLM forms translated to ours."""

    compat: list[str] = field(default_factory=list)
    mapped: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)  # keys a Hugging Face folder set (config/hf_folder.py)
    origins: dict = field(default_factory=dict)  # key set here -> the user's key it came from (for error lines)

    def lines(self) -> list[str]:
        """At most three log lines: the compatibility-only keys, the translations, the keys taken from the
        Hugging Face folder load_ckpt_info loads."""
        out = []
        if self.compat:
            out.append("config keys kept for compatibility only (no effect here, see README 'Coming from InternLM "
                       "or InternEvo'): " + ", ".join(self.compat))
        if self.mapped:
            out.append("config forms of InternLM/InternEvo mapped: " + "; ".join(self.mapped))
        if self.adopted:
            out.append("model keys left at their defaults, taken from the Hugging Face folder's config.json: "
                       + "; ".join(self.adopted))
        return out


# ---- compatibility-only keys: (section, key) -> why it has no effect ------------------------------------------------
# The one list of them (InternLM's spelling; dotted: inside a dict-valued key). A value predicate refuses values that
# would change the model or the training (then the message is the error). Most are removed; the schema keeps the
# values of the fields it marks `compat` (`_KEPT`). The sub-keys of the parallel dict forms (zero1.fsdp, tensor.*, ...)
# are also the only ones those forms accept besides the keys _parallel translates (`_PARALLEL_FORMS`).
Rule = tuple[Optional[Callable[[Any], bool]], str]

_COMPAT: dict[tuple[str, str], Rule] = {
    ("model", "embed_split_hidden"): (None, "DTensor plans decide the embedding's sharding"),
    ("model", "qk_interleaved"): (None, "rotary layout of InternEvo's q/k channels; InternEvo checkpoints are "
                                        "permuted on load as its model_config.pt says"),
    ("model", "adapt_hf"): (None, "the same as qk_interleaved (inverted)"),
    ("model", "residual_in_fp32"): (None, "residuals follow model.dtype and autocast"),
    ("model", "dropout_selective_checkpoint"): (None, "activation checkpointing is model.checkpoint"),
    ("model", "use_scaled_init"): (None, "every matrix starts from N(0, model.init_std)"),
    ("model", "init_type"): (lambda v: v in ("normal",), "only normal initialization is implemented"),
    ("model", "embedding_init_std"): (None, "model.init_std"),
    ("model", "attn_wqkv_init_std"): (None, "model.init_std"),
    ("model", "attn_other_init_std"): (None, "model.init_std"),
    ("model", "ffn_uplayer_init_std"): (None, "model.init_std"),
    ("model", "ffn_other_init_std"): (None, "model.init_std"),
    ("model", "out_head_init_std"): (None, "model.init_std"),
    ("model", "mlp_layer_fusion"): (None, "kernel choice"),
    ("model", "max_position_embeddings"): (None, "rotary tables are built for data.seq_len"),
    ("model", "rope_type"): (lambda v: str(v).lower() in ("normal", "default", "origin"),
                             "only the original rotary embedding is implemented"),
    ("model", "use_dynamic_ntk_rope"): (lambda v: not v, "dynamic NTK rotary scaling is not implemented"),
    ("model", "use_swiglu"): (lambda v: bool(v), "the feed-forward is SwiGLU only"),
    ("model", "norm_head"): (lambda v: not v, "a normalized output head is not implemented"),
    ("model", "is_reward"): (lambda v: not v, "reward models are not implemented"),
    ("model", "deepnorm"): (lambda v: not v, "DeepNorm is not implemented"),
    ("model", "attn_drop_rate"): (lambda v: not v, "dropout is not implemented (0 only)"),
    ("model", "drop_rate"): (lambda v: not v, "dropout is not implemented (0 only)"),
    ("model", "checkpoint_fraction"): (None, "model.checkpoint takes the fraction"),
    ("parallel", "zero1.fsdp"): (None, "sharding is always FSDP2 when parallel.zero1 != 1"),
    ("parallel", "pipeline.interleaved_overlap"): (None, "torch.distributed.pipelining schedules communication"),
    ("parallel", "pipeline.mode"): (None, "the schedule is parallel.pipeline_schedule's"),
    ("parallel", "tensor.overlap"): (None, "communication overlap is the compiler's and NCCL's"),
    ("parallel", "tensor.intern_overlap"): (None, "communication overlap is the compiler's and NCCL's"),
    ("parallel", "tensor.memory_pool"): (None, "the caching allocator"),
    ("parallel", "weight.overlap"): (None, "FSDP2 prefetches parameters"),
    ("parallel", "weight.memory_pool"): (None, "the caching allocator"),
    ("parallel", "weight.launch_allgather_before"): (None, "FSDP2 prefetches parameters"),
    ("parallel", "weight.forward_overlap_per"): (None, "FSDP2 prefetches parameters"),
    ("hybrid_zero_optimizer", "overlap_sync_grad"): (None, "FSDP2 overlaps gradient reduction"),
    ("hybrid_zero_optimizer", "overlap_sync_param"): (None, "FSDP2 prefetches parameters"),
    ("hybrid_zero_optimizer", "reduce_bucket_size"): (None, "FSDP2 reduces per block"),
    ("hybrid_zero_optimizer", "zero_overlap_communication"): (None, "FSDP2 overlaps gradient reduction"),
    ("lr_scheduler", "last_epoch"): (None, "the schedule's position is restored from checkpoints"),
    ("loss", "op_type"): (None, "the cross-entropy kernel is chosen by numerics.select_kernels"),
    ("data", "use_packed_dataset"): (lambda v: bool(v), "documents are always packed into rows"),
    ("data", "use_shm"): (None, "the index cache (data.index_cache_folder) is shared by the ranks"),
    ("data", "shm_path"): (None, "the index cache (data.index_cache_folder) is shared by the ranks"),
    ("data", "tokenizer_chunk_num"): (None, "streaming tokenizes in the loader"),
    ("data", "gradient_accumulation"): (None, "data.micro_num is the accumulation"),
    ("ckpt", "snapshot_ckpt_folder"): (None, "snapshots go to save_ckpt_folder/snapshot"),
    ("ckpt", "universal_ckpt"): (None, "checkpoints load into any layout already (DCP)"),
    ("monitor", "alert.light_monitor_address"): (None, "InternLM's light-monitor heartbeat is not sent; hangs are "
                                                       "watched by monitor.hang_timeout"),
    ("", "generation"): (None, "generation settings are not used by training"),
    ("", "metric_dtype"): (None, "metrics are computed in fp32"),
    ("", "tensorboard_folder"): (None, "TensorBoard writes into the run folder"),
    ("", "resume_tb_folder"): (None, "a resumed run writes on in its checkpoint's TensorBoard folder"),
}


def _schema_kept() -> dict[tuple[str, str], tuple[str, bool]]:
    """{(section, InternLM key): (the field's path in its section, whether it is a bool)} of the schema's fields
    marked `compat`: the compatibility-only keys whose values the schema keeps."""
    kept: dict[tuple[str, str], tuple[str, bool]] = {}

    def walk(cls: type, section: str, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for fl in dataclasses.fields(cls):
            tp, path = hints[fl.name], prefix + fl.name
            if dataclasses.is_dataclass(tp):  # a section (top level), or a sub-section inside one (monitor.alert)
                if section:
                    walk(tp, section, path + ".")
                else:
                    walk(tp, fl.name, "")
            elif fl.metadata.get("compat"):
                mark = fl.metadata["compat"]
                kept[(section, path if mark is True else mark)] = (path, tp is bool)
    walk(Config, "", "")
    return kept


_KEPT = _schema_kept()
if not set(_KEPT) <= set(_COMPAT):  # a key the schema keeps is checked and noted by its rule, like the others
    raise RuntimeError(f"schema fields marked compat without a rule in config/compat.py _COMPAT: "
                       f"{sorted(set(_KEPT) - set(_COMPAT))}")


def _key(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


def _note(section: str, key: str, value: Any, notes: CompatNotes) -> None:
    """Note a compatibility-only key; refuse a value that would change the model or the training (its rule)."""
    ok, why = _COMPAT[(section, key)]
    if ok is not None and not ok(value):
        raise ConfigError(f"{_key(section, key)}={value!r}: {why}")
    notes.compat.append(_key(section, key))


def _take(section_dict: dict, section: str, key: str, notes: CompatNotes) -> None:
    """Remove a compatibility-only key (or keep it when the schema has the field), noting it; refuse values that
    would change the model."""
    path = key.split(".")
    node = section_dict
    for p in path[:-1]:
        node = node.get(p) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return
    if path[-1] not in node:
        return
    _note(section, key, node[path[-1]], notes)
    if (section, key) not in _KEPT:
        del node[path[-1]]


def _take_section(section_dict: dict, section: str, notes: CompatNotes) -> None:
    """`_take` every compatibility-only key of `section` that `section_dict` holds, in _COMPAT's order."""
    for (s, key) in _COMPAT:
        if s == section:
            _take(section_dict, section, key, notes)


# InternLM's dict forms of parallel keys → the sub-keys _parallel translates (as the error message lists them); the
# other sub-keys each form accepts are its compatibility-only keys in _COMPAT ("<form>.<sub-key>")
_PARALLEL_FORMS = {"zero1": ("size",), "pipeline": ("size", "zero_bubble"),
                   "tensor": ("size", "mode (mtp, msp, fsp, isp)", "sp"), "weight": ("size",)}


def _sub_keys(form: str) -> list[str]:
    """The compatibility-only sub-keys of InternLM's parallel.<form>=dict(...), from _COMPAT."""
    return [key[len(form) + 1:] for (section, key) in _COMPAT if section == "parallel" and key.startswith(form + ".")]


def _unpack(form: str, value: Any) -> dict:
    """InternLM's parallel.<form>=dict(...) as a new dict, its keys checked (a typo is an error, not ignored)."""
    value = dict(value)
    unknown = sorted(set(value) - {label.split()[0] for label in _PARALLEL_FORMS[form]} - set(_sub_keys(form)))
    if unknown:
        raise ConfigError(f"parallel.{form}: unknown key(s) {unknown}; expected "
                          f"{', '.join((*_PARALLEL_FORMS[form], *_sub_keys(form)))}")
    return value


def _take_sub_keys(par: dict, form: str, value: dict, notes: CompatNotes) -> None:
    """Note the compatibility-only sub-keys of parallel.<form>=dict(...); the schema keeps some of them under a flat
    name (zero1.fsdp → parallel.zero1_fsdp: the fields it marks compat="zero1.fsdp"), truthy as InternLM reads them."""
    for sub in _sub_keys(form):
        if sub in value:
            _note("parallel", f"{form}.{sub}", value[sub], notes)
            if ("parallel", f"{form}.{sub}") in _KEPT:
                home, is_bool = _KEPT[("parallel", f"{form}.{sub}")]
                par[home] = bool(value[sub]) if is_bool else value[sub]


def _parallel(raw: dict, notes: CompatNotes) -> None:
    """The parallel section's dict forms (InternLM's zero1 and pipeline, InternEvo's tensor and weight) → our flat
    keys; InternEvo's isp and sequence_2D onto parallel.context (context.py); then its compatibility-only keys."""
    par = raw.get("parallel")
    if not isinstance(par, dict):
        return
    par = raw["parallel"] = dict(par)
    for form, default_size in (("zero1", -1), ("pipeline", 1)):
        if isinstance(par.get(form), dict):
            value = _unpack(form, par[form])
            par[form] = value.get("size", default_size)
            _take_sub_keys(par, form, value, notes)
            if form == "pipeline" and value.get("zero_bubble"):
                _zero_bubble(par, raw, notes)
    isp_size = par["tensor"].get("size", 1) if isinstance(par.get("tensor"), dict) else None
    tensor_mode = _tensor(par, notes)
    # InternEvo's isp (and sequence_2D over it) is context parallel here; `parallel.context=N` becomes a dict
    context_forms(par, isp_size if tensor_mode == "isp" else None, notes.mapped, notes.compat)
    _weight(par, tensor_mode, notes)
    _take_section(par, "parallel", notes)  # the dotted ones are gone with their dicts: what is left, top-level keys


def _zero_bubble(par: dict, raw: dict, notes: CompatNotes) -> None:
    """InternEvo's parallel.pipeline=dict(zero_bubble=True) -> parallel.pipeline_schedule: its ZB-H1 (one chunk per
    rank) as torch's interleaved_zb, its ZB-V (two) as zbv (config/pipeline.py); an explicit other schedule refused.
    Pipeline size 1 (InternEvo then runs no pipeline either): noted, nothing to schedule."""
    if par["pipeline"] == 1:
        notes.mapped.append("parallel.pipeline.zero_bubble=True with pipeline size 1: no pipeline to schedule")
        return
    model = raw.get("model")
    name = zero_bubble_schedule(model.get("num_chunks", 1) if isinstance(model, dict) else 1)
    if par.get("pipeline_schedule", name) != name:
        raise ConfigError(f"parallel.pipeline.zero_bubble=True maps to parallel.pipeline_schedule={name!r}, but "
                          f"parallel.pipeline_schedule={par['pipeline_schedule']!r} is set; set only one of them")
    par["pipeline_schedule"] = name
    notes.origins["parallel.pipeline_schedule"] = "parallel.pipeline.zero_bubble=True"
    notes.mapped.append(f"parallel.pipeline.zero_bubble=True -> parallel.pipeline_schedule={name!r}")


def _tensor(par: dict, notes: CompatNotes) -> Optional[str]:
    """parallel.tensor=dict(size, mode) (InternEvo; `sp` on InternLM's develop branch) → tensor parallel of that size,
    with sequence parallel for the modes that shard activations (isp: tensor 1, context parallel of that size, see
    context.py); the mode in InternEvo's spelling (None: no dict)."""
    if not isinstance(par.get("tensor"), dict):
        return None
    t = _unpack("tensor", par["tensor"])
    size = t.get("size", 1)
    mode = t.get("mode")
    if mode is None and "sp" in t:
        mode = t["sp"]
    mode = "mtp" if mode is None else str(mode)
    if mode not in _TENSOR_MODES:
        raise ConfigError(f"parallel.tensor.mode: expected one of mtp, msp, fsp, isp (or origin_tp, fstp), "
                          f"got {mode!r}")
    par["tensor"] = 1 if mode in _ISP else size  # isp: context parallel of that size (context_forms)
    _take_sub_keys(par, "tensor", t, notes)
    if mode in _ISP:
        if size == 1:
            notes.mapped.append(f"parallel.tensor.mode={mode!r} size 1 -> no tensor or context parallel")
    elif _TENSOR_MODES[mode] and isinstance(size, int) and size > 1:
        par["sequence_parallel"] = True
    if mode not in _ISP and mode != "mtp":
        notes.mapped.append(f"parallel.tensor.mode={mode!r} -> tensor parallel {size}"
                            + (" with sequence parallel" if par.get("sequence_parallel") else ""))
    return _SP_SPELLINGS.get(mode, mode)


def _weight(par: dict, tensor_mode: Optional[str], notes: CompatNotes) -> None:
    """InternEvo's parallel.weight (weight parallel, only with the isp tensor mode): what FSDP2 does over the
    data-parallel ranks, so it is removed; a size above 1 is noted as that mapping."""
    w = par.pop("weight", None)
    if w is None:
        return
    w = _unpack("weight", {"size": w} if isinstance(w, int) else w)
    wsize = w.get("size", 1)
    if isinstance(wsize, int) and wsize > 1:
        if tensor_mode != "isp":
            raise ConfigError(f"parallel.weight.size={wsize}: weight parallel needs parallel.tensor.mode='isp' "
                              f"(InternEvo's rule); to shard parameters use parallel.zero1 (FSDP over data "
                              f"parallel)")
        notes.mapped.append(f"parallel.weight.size={wsize} (weight parallel: each parameter sharded and "
                            f"gathered per layer) is what FSDP2 does here, over the data-parallel ranks "
                            f"(parallel.zero1={par.get('zero1', -1)})")
    else:
        notes.compat.append("parallel.weight")
    _take_sub_keys(par, "weight", w, notes)


def _model(raw: dict, notes: CompatNotes) -> None:
    model = raw.get("model")
    if not isinstance(model, dict):
        return
    model = raw["model"] = dict(model)
    mtp_forms(model, notes.mapped)  # DeepSeek's num_nextn_predict_layers, Megatron's mtp_* -> model.mtp
    if "no_bias" in model:
        no_bias = model.pop("no_bias")
        if model.get("qkv_bias") is None:
            model["qkv_bias"] = not bool(no_bias)
        notes.mapped.append(f"model.no_bias={no_bias} -> model.qkv_bias={model['qkv_bias']}")
    if "tie_embeddings_and_output_weights" in model:
        model.setdefault("tie_word_embeddings", bool(model.pop("tie_embeddings_and_output_weights")))
    if model.get("use_dynamic_ntk_rope") and model.get("rope_scaling") is None:
        # InternEvo's dynamic NTK: rope_scaling_factor beyond max_position_embeddings, model.rope_scaling's form
        f = model.pop("rope_scaling_factor", 1.0)
        model.pop("use_dynamic_ntk_rope")
        original = model.pop("max_position_embeddings", None)
        model["rope_scaling"] = dict(type="dynamic", factor=f, original_max_position_embeddings=original)
        notes.mapped.append(f"model.use_dynamic_ntk_rope, rope_scaling_factor={f}, max_position_embeddings="
                            f"{original} -> model.rope_scaling={model['rope_scaling']}")
    if "rope_scaling_factor" in model:
        f = model.pop("rope_scaling_factor")
        if f not in (None, 1, 1.0):
            raise ConfigError(f"model.rope_scaling_factor={f!r}: InternEvo scales only with use_dynamic_ntk_rope="
                              f"True; write model.rope_scaling=dict(type='linear' or 'dynamic', factor={f!r})")
        notes.compat.append("model.rope_scaling_factor")
    _take_section(model, "model", notes)


def _ckpt(raw: dict, notes: CompatNotes) -> None:
    ckpt = raw.get("ckpt")
    if not isinstance(ckpt, dict):
        return
    ckpt = raw["ckpt"] = dict(ckpt)
    for key in ("save_ckpt_folder", "load_ckpt_folder", "load_model_only_folder"):
        if isinstance(ckpt.get(key), str):
            ckpt[key] = strip_local_prefix(ckpt[key])
    info = ckpt.get("load_ckpt_info")
    if isinstance(info, dict):
        info = dict(info)
        if isinstance(info.get("path"), str):
            info["path"] = strip_local_prefix(info["path"])
        ckpt["load_ckpt_info"] = info
    # InternLM's legacy keys, read as internlm/initialize/legacy/launch.py reads them
    folder = ckpt.pop("load_ckpt_folder", None)
    model_only = ckpt.pop("load_model_only_folder", None)
    load_optimizer = ckpt.pop("load_optimizer", True)
    given = ckpt.pop("load_given_ckpt", None)
    if ckpt.get("load_ckpt_info") is None and (folder is not None or model_only is not None):
        if model_only is not None:
            if folder is not None:
                raise ConfigError("ckpt.load_ckpt_folder and ckpt.load_model_only_folder are both set; set one "
                                  "(InternLM's rule)")
            ckpt["load_ckpt_info"] = {"path": model_only, "content": ("model",), "ckpt_type": "internlm"}
        elif isinstance(folder, str):
            content = ("model", "sampler", "optimizer") if load_optimizer else ("model", "sampler")
            ckpt["load_ckpt_info"] = {"path": folder, "content": content, "ckpt_type": "internlm"}
        else:
            raise ConfigError(f"ckpt.load_ckpt_folder: expected a path, got {folder!r}")
        notes.mapped.append(f"legacy ckpt.load_{'model_only' if model_only is not None else 'ckpt'}_folder -> "
                            f"load_ckpt_info={ckpt['load_ckpt_info']}")
    elif folder is not None or model_only is not None:
        notes.compat.append("ckpt.load_ckpt_folder (load_ckpt_info is set and wins, as in InternLM)"
                            if folder is not None else "ckpt.load_model_only_folder (load_ckpt_info wins)")
    if "auto_resume" not in ckpt and given is not None:
        ckpt["auto_resume"] = not bool(given)
        notes.mapped.append(f"legacy ckpt.load_given_ckpt={given} -> auto_resume={not bool(given)}")
    _take_section(ckpt, "ckpt", notes)


def _monitor(raw: dict, notes: CompatNotes) -> None:
    if "alert_address" in raw:  # InternLM's old top-level alert address
        address = raw.pop("alert_address")
        mon = raw["monitor"] = dict(raw.get("monitor") or {})
        alert = mon["alert"] = dict(mon.get("alert") or {})
        if address and not alert.get("feishu_alert_address"):
            alert["feishu_alert_address"] = address
        notes.mapped.append("alert_address -> monitor.alert.feishu_alert_address")
    if "enable_tb" in raw:
        mon = raw["monitor"] = dict(raw.get("monitor") or {})
        mon.setdefault("tensorboard", bool(raw.pop("enable_tb")))
    mon = raw.get("monitor")
    if not isinstance(mon, dict):
        return
    mon = raw["monitor"] = dict(mon)
    if isinstance(mon.get("alert"), dict):
        mon["alert"] = dict(mon["alert"])  # a copy: a compatibility key inside it may be removed
    _take_section(mon, "monitor", notes)
    tb = mon.get("tensorboard")
    if isinstance(tb, dict):
        unknown = sorted(set(tb) - {"queue_max_length", "enable"})
        if unknown:
            raise ConfigError(f"monitor.tensorboard: unknown key(s) {unknown}; expected queue_max_length")
        mon["tensorboard"] = bool(tb.get("enable", True))
        if "queue_max_length" in tb:
            notes.compat.append("monitor.tensorboard.queue_max_length")


def strip_local_prefix(location: str) -> str:
    """A location without InternLM's `local:` prefix; `boto3:` stays, it tells how to read the bucket string."""
    return location[len("local:"):] if location.startswith("local:") else location


def normalize(raw: dict) -> tuple[dict, CompatNotes]:
    """Map InternLM's and InternEvo's forms onto the schema (a new dict; `raw` is not changed)."""
    raw = copy.copy(raw)
    notes = CompatNotes()
    raw = moe_forms(raw, notes.compat, notes.mapped)  # MoE families keep their keys; dense ones drop them
    if raw.get("use_apex_adam") is not None:
        use = raw.pop("use_apex_adam")
        if use:
            adam = raw["adam"] = dict(raw.get("adam") or {})
            adam.setdefault("fused", "apex")
        notes.mapped.append(f"use_apex_adam={use} -> adam.fused")
    _parallel(raw, notes)
    _model(raw, notes)
    _ckpt(raw, notes)
    _monitor(raw, notes)
    gs = raw.get("grad_scaler")
    if isinstance(gs, dict) and isinstance(gs.get("fp16"), dict):
        gs = dict(gs)
        gs.update(gs.pop("fp16"))
        raw["grad_scaler"] = gs
    for section in ("hybrid_zero_optimizer", "lr_scheduler", "loss", "data"):
        if isinstance(raw.get(section), dict):
            raw[section] = dict(raw[section])
            _take_section(raw[section], section, notes)
    _take_section(raw, "", notes)
    return raw, notes
