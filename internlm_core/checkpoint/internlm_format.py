"""InternLM's own checkpoint folders (InternLM at aaaf4d7, InternEvo): read into any layout, and written.

A folder holds `model_tp{t}_pp{p}.pt` (one state dict per tensor and pipeline rank of the run that saved it, keys
under "model." as InternLM's NaiveAMPModel names them, layers numbered from 0 on every stage), `model_config.pt`
(InternLM's `model` section), InternEvo's MoE experts in files of their own (`model_moe_layer{L}_expert{e}_tp{t}.pt`,
merged into tensor rank t's state dict on read, split out on write) and, for InternLM's own resume, optimizer/scheduler/sampler files this reader does not
use (InternLM's HybridZeroOptimizer state has no meaning for AdamW under FSDP2: a load is model content).

Reading merges the pipeline stages as InternLM's tools/transformers/convert2hf.py does (each stage's layer numbers
shifted past the previous stage's largest) and hands {tensor rank: state dict} to the model family's "internlm"
adapter, which merges the tensor shards by InternLM's rules. Every file is read with
`torch.load(weights_only=True)`: tensors and plain containers only, so a crafted `.pt` cannot run code.
Writing splits layers over pipeline stages as InternLM's partition_uniform does and tensors by the adapter.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch

from ..errors import CheckpointError
from ..model.spec import StateDictAdapter, get_model_spec
from ..numerics.precision import resolve_precision
from .foreign import check_model_keys, context, find_adapter, groups, load_full_state, select_layers
from .safetensors_io import safe_load

MODEL_FILE = re.compile(r"^model_tp(\d+)_pp(\d+)\.pt$")
FSDP_FILE = re.compile(r"^model_tp(\d+)_pp(\d+)_(?:dp|zo)(\d+)\.pt$")
# InternEvo's MoE experts, one file per (global layer, expert, expert tensor/weight-parallel rank)
MOE_FILE = re.compile(r"^model_moe_layer(\d+)_expert(\d+)_(tp|wp)(\d+)\.pt$")
_EXPERT_IN_KEY = re.compile(r"(?:^|\.)(?:blocks|layers)\.(\d+)\.(.*\.experts\.wrapped_experts\.\d+\..+)$")
MODEL_CONFIG = "model_config.pt"
_LAYER = re.compile(r"\.(\d+)\.")
_EXPERT_FILE_KEY = re.compile(r"\.experts\.wrapped_experts\.(\d+)\.")
# the model_config.pt keys a load checks against the built model (the FFN width comes from the tensors)
_CHECKED = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "num_kv_attention_heads")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_internlm_folder(folder: str | os.PathLike) -> bool:
    """True when `folder` holds InternLM model files (`model_tp{t}_pp{p}.pt`)."""
    p = Path(folder)
    return p.is_dir() and any(MODEL_FILE.match(f.name) or FSDP_FILE.match(f.name) for f in p.iterdir())


def folder_layout(folder: Path) -> tuple[int, int]:
    """(tensor, pipeline) sizes of the run that saved `folder`; every (t, p) file must be there."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: InternLM checkpoint folder not found")
    names = [f.name for f in folder.iterdir()]
    if any(FSDP_FILE.match(n) for n in names):
        raise CheckpointError(f"{folder}: an FSDP-sharded InternLM checkpoint (model_tp*_pp*_dp*.pt); save it from "
                              f"InternLM without parallel.zero1.fsdp (or merge its shards) first")
    found = {(int(m.group(1)), int(m.group(2))) for n in names if (m := MODEL_FILE.match(n))}
    if not found:
        raise CheckpointError(f"{folder}: no InternLM model files (model_tp{{t}}_pp{{p}}.pt)")
    tp, pp = max(t for t, _ in found) + 1, max(p for _, p in found) + 1
    missing = sorted({(t, p) for t in range(tp) for p in range(pp)} - found)
    if missing:
        raise CheckpointError(f"{folder}: incomplete InternLM checkpoint: model_tp{missing[0][0]}_pp{missing[0][1]}.pt "
                              f"is missing ({len(missing)} of {tp * pp} files)")
    return tp, pp


def merge_stages(stages: list[Mapping[str, Any]], where: str) -> dict[str, torch.Tensor]:
    """One tensor rank's pipeline stages as one state dict with global layer numbers ("model." removed)."""
    out: dict[str, torch.Tensor] = {}
    shift = 0
    for p, states in enumerate(stages):
        if not isinstance(states, Mapping):
            raise CheckpointError(f"{where}: pipeline stage {p} is not a state dict")
        top = 0
        for key, value in states.items():
            name = key[len("model."):] if key.startswith("model.") else key
            if re.match(r"^\d+\.", name):
                raise CheckpointError(f"{where}: an interleaved pipeline checkpoint (model.num_chunks > 1, key "
                                      f"{key!r}) is not supported")
            if not isinstance(value, torch.Tensor):
                continue
            m = _LAYER.search(name)
            if m:
                top = max(top, int(m.group(1)))
                name = f"{name[:m.start()]}.{int(m.group(1)) + shift}.{name[m.end():]}"
            out[name] = value
        shift += top + 1
    return out


def read_expert_files(folder: Path, tp: int) -> dict[int, dict[str, torch.Tensor]]:
    """InternEvo's MoE expert files as {expert tensor rank: {blocks.{L}.mlp...wrapped_experts.{e}.w: tensor}}.

    The file name holds the global layer L (InternEvo numbers MoE layers across pipeline stages); the keys inside
    hold the stage's own block number, so the name's L replaces it. Experts saved under InternEvo's isp mode are
    named by weight-parallel rank (`_wp{r}`): whole experts when one rank saved them; split ones are refused."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for f in sorted(folder.iterdir()):
        m = MOE_FILE.match(f.name)
        if m is None:
            continue
        layer, mode, rank = int(m.group(1)), m.group(3), int(m.group(4))
        if mode == "wp" and rank > 0:
            raise CheckpointError(f"{f}: experts split over InternEvo's expert weight-parallel ranks (isp) are not "
                                  f"supported; save them with parallel.expert_weight size 1")
        if rank >= tp:
            raise CheckpointError(f"{f}: expert tensor rank {rank}, but the folder's model files have {tp} tensor "
                                  f"rank(s)")
        states = safe_load(f)
        if not isinstance(states, Mapping):
            raise CheckpointError(f"{f}: expected a state dict of one expert's weights")
        for key, value in states.items():
            k = key[len("model."):] if key.startswith("model.") else key
            km = _EXPERT_IN_KEY.search(k)
            if km is None or not isinstance(value, torch.Tensor):
                raise CheckpointError(f"{f}: key {key!r} is not an expert weight (blocks.N.mlp.moe_layer.experts."
                                      f"wrapped_experts.E.w*.weight)")
            out.setdefault(rank, {})[f"blocks.{layer}.{km.group(2)}"] = value
    return out


def read_internlm_folder(folder: str | os.PathLike) -> tuple[dict[int, dict[str, torch.Tensor]], dict]:
    """({tensor rank: state dict, stages merged, InternEvo's expert files in it}, model_config.pt's dict or {})."""
    folder = Path(folder)
    tp, pp = folder_layout(folder)
    shards = {t: merge_stages([safe_load(folder / f"model_tp{t}_pp{p}.pt") for p in range(pp)], str(folder))
              for t in range(tp)}
    for t, experts in read_expert_files(folder, tp).items():
        shards[t].update(experts)
    config: dict = {}
    if (folder / MODEL_CONFIG).is_file():
        loaded = safe_load(folder / MODEL_CONFIG)
        config = dict(loaded) if isinstance(loaded, Mapping) else {}
    return shards, config


def _check_config(config: Mapping[str, Any], adapter: StateDictAdapter, args: Any, folder: Any) -> None:
    """The model's shape against the folder's model_config.pt (when it has one)."""
    if config and adapter.config_from_foreign is not None:
        keys = adapter.config_from_foreign(config)  # type: ignore[call-arg]
        check_model_keys(args, {k: v for k, v in keys.items() if k in _CHECKED}, str(folder),
                         "the checkpoint's model_config.pt")


def load_internlm(model: torch.nn.Module, folder: str | os.PathLike, model_type: Optional[str] = None,
                  strict: bool = True) -> list[str]:
    """Load an InternLM / InternEvo folder (any tensor/pipeline split) into our built `model` (any layout)."""
    adapter = find_adapter(model_type, "internlm")
    args = getattr(model, "args", None)
    if args is None:
        raise CheckpointError("an InternLM checkpoint loads into internlm-core's model (it has no .args here)")

    state: dict[str, Any] = {}  # the folder, read once (memory-mapped) by the reading rank

    def read(metas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not state:
            state["shards"], state["config"] = read_internlm_folder(folder)
            _check_config(state["config"], adapter, args, folder)
        shards, config = state["shards"], state["config"]
        part = {t: select_layers(sd, metas) for t, sd in shards.items()}  # this layer's tensors only
        sd = adapter.from_foreign(part, context(args, tp=len(shards), options=config))
        return {k: v for k, v in sd.items() if k in metas}

    return load_full_state(model, read, str(folder), strict=strict)


def partition_uniform(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """InternLM's layer split: num_layers // stages each, the remainder to the last stages."""
    size, rest = divmod(num_layers, stages)
    out, start = [], 0
    for p in range(stages):
        n = size + (1 if p >= stages - rest else 0)
        out.append((start, start + n))
        start += n
    return out


def write_internlm_folder(out_dir: str | os.PathLike, cfg: Any,
                          source: Mapping[str, torch.Tensor] | Callable[[list[str]], Mapping[str, torch.Tensor]],
                          tp: int = 1, pp: int = 1, dtype: Optional[str] = None,
                          progress: Optional[Callable[[str], None]] = None) -> list[Path]:
    """Write the model of `cfg` as an InternLM folder split `tp` x `pp` (model_tp{t}_pp{p}.pt, model_config.pt).

    source: our full state dict, or a function giving the tensors of a list of our names (one layer at a time).
    dtype: "float32", "bfloat16" or "float16"; default the run's `model.dtype`.
    """
    from ..model import model_args_from_config

    dtype = dtype or resolve_precision(cfg.model.dtype, "cpu").export_name
    if dtype not in _DTYPES:
        raise CheckpointError(f"dtype {dtype!r}: expected one of {', '.join(_DTYPES)}")
    adapter = get_model_spec(cfg.model_type).adapters.get("internlm")
    if adapter is None:
        raise CheckpointError(f"model_type {cfg.model_type} has no InternLM checkpoint format")
    m = cfg.model
    if tp < 1 or pp < 1 or m.num_layers < pp:
        raise CheckpointError(f"--tp {tp} --pp {pp}: expected positive sizes and at most {m.num_layers} stages")
    for what, n in (("num_attention_heads", m.num_attention_heads), ("num_kv_attention_heads",
                    m.num_kv_attention_heads), ("vocab_size", m.vocab_size), ("hidden_size", m.hidden_size)):
        if n % tp:
            raise CheckpointError(f"--tp {tp} must divide model.{what} ({n})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    args = model_args_from_config(cfg)
    shapes = get_model_spec(cfg.model_type).parameter_shapes(args)
    ctx = context(args, tp=tp, options={"embed_split_hidden": True})
    load = (lambda names: {n: source[n] for n in names}) if isinstance(source, Mapping) else source
    plan = groups(shapes)
    order = list(plan)
    layer_of = {key: int(_LAYER.search(key + ".").group(1)) for key in plan if _LAYER.search(key + ".")}
    first_layer = min(order.index(k) for k in layer_of)
    files = []
    experts: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}  # (global layer, expert, tensor rank)
    for p, (lo, hi) in enumerate(partition_uniform(m.num_layers, pp)):
        # groups before the layers (the embedding) go to the first stage, those after them to the last
        keys = [k for i, k in enumerate(order) if (k in layer_of and lo <= layer_of[k] < hi) or
                (k not in layer_of and ((p == 0 and i < first_layer) or (p == pp - 1 and i > first_layer)))]
        stage: dict[int, dict[str, torch.Tensor]] = {t: {} for t in range(tp)}
        for key in keys:
            names = plan[key]
            got = load(names)
            full = {n: got[n].detach().to(device="cpu", dtype=_DTYPES[dtype]) for n in names}
            for n in names:
                if tuple(full[n].shape) != tuple(shapes[n].shape):
                    raise CheckpointError(f"parameter {n} has shape {tuple(full[n].shape)}, the config's model "
                                          f"expects {tuple(shapes[n].shape)}")
            for t, sd in adapter.to_foreign(full, ctx).items():
                for name, tensor in sd.items():
                    mm = _LAYER.search(name)
                    if mm:  # InternLM numbers the layers of every stage from 0
                        name = f"{name[:mm.start()]}.{int(mm.group(1)) - lo}.{name[mm.end():]}"
                    em = _EXPERT_FILE_KEY.search(name)
                    if em:  # InternEvo saves each expert in its own file, named by the global layer
                        experts.setdefault((int(mm.group(1)), int(em.group(1)), t), {})["model." + name] = tensor
                        continue
                    stage[t]["model." + name] = tensor
        for t in range(tp):
            path = out / f"model_tp{t}_pp{p}.pt"
            torch.save(stage[t], path)
            files.append(path)
        for (layer, e, t), sd in sorted(experts.items()):
            path = out / f"model_moe_layer{layer}_expert{e}_tp{t}.pt"
            torch.save(sd, path)
            files.append(path)
        experts.clear()
        if progress is not None:
            progress(f"pipeline stage {p}: layers {lo}..{hi - 1}, {tp} tensor shard(s)")
    config = adapter.foreign_config(cfg.model_inputs(), dtype) if adapter.foreign_config is not None else {}
    torch.save(config, out / MODEL_CONFIG)
    files.append(out / MODEL_CONFIG)
    return files



def export_internlm_checkpoint(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, cfg: Any = None,
                               tp: int = 1, pp: int = 1, dtype: Optional[str] = None,
                               allow_incomplete: bool = False,
                               progress: Optional[Callable[[str], None]] = None) -> list[Path]:
    """Convert an internlm-core checkpoint (any layout; local or s3://) into an InternLM folder split tp x pp."""
    from .catalog import checkpoint_config, local_checkpoint
    from ..model import model_args_from_config
    from .hf import find_dcp_model

    with local_checkpoint(ckpt_dir, allow_incomplete) as (folder, which):
        if progress is not None:
            progress(which)
        cfg = cfg if cfg is not None else checkpoint_config(folder)
        names = get_model_spec(cfg.model_type).parameter_shapes(model_args_from_config(cfg))
        model = find_dcp_model(folder, list(names))
        if progress is not None:
            progress(f"model state: key prefix {model.prefix!r}, {len(model.tensors)} tensors; {cfg.model_type} -> "
                     f"InternLM folder, tensor {tp} x pipeline {pp}")
        return write_internlm_folder(out_dir, cfg, model.load, tp=tp, pp=pp, dtype=dtype, progress=progress)
