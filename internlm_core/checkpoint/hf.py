"""Hugging Face interchange: import HF folders into a built model, export our checkpoints as HF folders.

Which HF class a family reads and writes, its names and config.json, are the family's `StateDictAdapter`s
(model/<family>/hf.py: "hf" its own class, "hf_llama" LlamaForCausalLM); this file names no parameter path.
safetensors reading and writing are in safetensors_io.py, tokenizer files in tokenizer_export.py, which checkpoint
a path names in catalog.py.

Import (`load_hf`, ckpt_type "hf" / "hf_llama") fills a built model, plain, FSDP2 / tensor-parallel or one
pipeline stage, from the folder's class (config.json `architectures`). Export reads the model part of a DCP
checkpoint (any data/tensor/pipeline layout: DCP stores global tensors) one layer group at a time, so peak memory
is about one safetensors shard, not the whole model.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch

from ..errors import CheckpointError
from ..model.foreign_keys import args_value, differences
from ..model.spec import StateDictAdapter, get_model_spec, model_types
from ..numerics.precision import resolve_precision
from . import fp8_blocks
from .catalog import checkpoint_config, local_checkpoint
from .foreign import context, find_adapter, groups, load_full_state
from .safe_dcp import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata
from .safetensors_io import hf_safetensors_files, parse_size, read_hf_tensors, read_json, write_safetensors_shards
from .tokenizer_export import write_tokenizer_files

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_classes() -> dict[str, str]:
    """HF config.json model_type → its class, of every registered family's Hugging Face adapters
    (`StateDictAdapter.hf_model_types`): what names the class of a folder whose config.json lacks "architectures",
    and the `arch` names of an export."""
    out: dict[str, str] = {}
    for name in model_types():
        for ad in get_model_spec(name).adapters.values():
            if ad.format == "hf":
                out.update({mt: arch for mt, arch in zip(ad.hf_model_types, ad.architectures) if mt not in out})
    return out


# ---------------------------------------------------------------------------------------------------------
# import into a model

def hf_class(hf_dir: str | os.PathLike) -> tuple[str, dict]:
    """(the HF class of a folder, its config.json)."""
    path = Path(hf_dir) / "config.json"
    c = read_json(path)
    archs = c.get("architectures") or []
    mt = c.get("model_type")
    classes = hf_classes()
    arch = archs[0] if archs else classes.get(str(mt))
    if arch is None or (mt is not None and classes.get(str(mt)) != arch):
        raise CheckpointError(f"{path}: model_type {mt!r} ({', '.join(archs) or 'no architectures'}); internlm-core "
                              f"reads Hugging Face folders of model_type {', '.join(classes)}")
    return arch, c


def hf_adapter(hf_dir: str | os.PathLike, model_type: Optional[str] = None) -> tuple[StateDictAdapter, dict]:
    """The family adapter that reads the folder's class (of `model_type`, or of any family), and config.json."""
    arch, c = hf_class(hf_dir)
    return find_adapter(model_type, "hf", arch, where=f"{Path(hf_dir) / 'config.json'}: "), c


def config_from_hf(hf_dir: str | os.PathLike, model_type: Optional[str] = None) -> dict:
    """Our `model` keys of the model in `hf_dir` (what the family cannot compute is a CheckpointError)."""
    adapter, c = hf_adapter(hf_dir, model_type)
    return adapter.config_from_foreign(c, str(Path(hf_dir) / "config.json"))  # type: ignore[misc, call-arg]


HARMLESS = (".rotary_emb.inv_freq",)  # buffers older transformers saved: recomputed from rope_theta on both sides


def empty_tensor(path: Path, name: str) -> bool:
    """Whether the folder's tensor `name` (in safetensors file `path`) has no element: it holds no weight, so the
    model is the same without it (DeepseekV3's shared experts of width 0 where n_shared_experts is 0)."""
    if Path(path).suffix != ".safetensors":
        return False
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return 0 in f.get_slice(name).get_shape()


def check_hf_model(args: Any, keys: Mapping[str, Any], c: Mapping[str, Any], where: str,
                   keep: tuple[str, ...] = ()) -> None:
    """CheckpointError (one line naming both sides) when a built model (its ModelArgs) differs from the folder's
    config.json in any key the family's adapter reads (`keys`: shape, numerics, windows, routing), but the dotted
    config keys in `keep` (ckpt.load_ckpt_info.keep_run_keys)."""
    arch = (c.get("architectures") or [""])[0]
    diff = differences(keys, lambda k: args_value(k, args), c, arch, keep)
    if diff:
        raise CheckpointError(f"{where}: the model differs from the folder's config.json: "
                              f"{'; '.join(d for _, d in diff)} (build it from internlm_core.checkpoint.hf."
                              f"config_from_hf, or name the key in ckpt.load_ckpt_info.keep_run_keys)")


def load_hf(model: torch.nn.Module, hf_dir: str | os.PathLike, model_type: Optional[str] = None,
            strict: bool = True, keep: tuple[str, ...] = ()) -> list[str]:
    """Load a Hugging Face folder (safetensors) into our built `model`; returns the parameter names loaded.

    The folder's class picks the adapter (of `model_type`'s family when given). The model must be the folder's:
    every key of config.json the model depends on equal (`check_hf_model`; `keep`: dotted config keys whose run
    value is kept on purpose), and every tensor of the folder read (a tensor nothing reads is refused, naming it).
    A block-scaled FP8 folder (config.json quantization_config) is read dequantized (fp8_blocks.py).
    """
    adapter, c = hf_adapter(hf_dir, model_type)
    where = str(Path(hf_dir) / "config.json")
    fp8 = fp8_blocks.block_size(c, where)
    keys = adapter.config_from_foreign(c, where)  # type: ignore[misc, call-arg]
    args = getattr(model, "args", None)
    if args is not None:
        check_hf_model(args, keys, c, where, tuple(keep))
    ctx = context(args)
    state: dict[str, Any] = {}  # the folder's tensor index, read once (on the reading rank)

    def names_of(metas: dict[str, torch.Tensor]) -> list[str]:
        wanted: list[str] = []
        for group in groups(metas).values():
            foreign = adapter.to_foreign({n: metas[n] for n in group}, ctx)
            wanted.extend(f for f in foreign if f not in wanted)
        return wanted

    def available() -> Mapping[str, Any]:
        if "available" not in state:
            state["available"] = hf_safetensors_files(hf_dir)
        return state["available"]

    def unread(metas: dict[str, torch.Tensor]) -> str:
        wanted = set(names_of(metas))
        left = [f for f in available() if f not in wanted and not f.endswith(HARMLESS)
                and not (fp8 and fp8_blocks.is_scale_of(f, wanted)) and not empty_tensor(available()[f], f)]
        if not left:
            return ""
        return (f"{hf_dir}: {len(left)} tensor(s) of the folder that nothing in the {model_type or 'built'} model "
                f"reads: {', '.join(left[:4])}{', ...' if len(left) > 4 else ''} (loading without them gives "
                f"another model than the folder's)")

    def read(metas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        wanted = names_of(metas)
        missing = [f for f in wanted if f not in available()]
        if missing and strict:
            raise CheckpointError(f"{hf_dir}: missing {len(missing)} tensor(s) the model needs, e.g. "
                                  f"{', '.join(missing[:3])}")
        present = [f for f in wanted if f in available()]
        tensors = read_hf_tensors(hf_dir, present + (fp8_blocks.scale_names(present, available()) if fp8 else []))
        ours = adapter.from_foreign(fp8_blocks.dequantize_all(tensors, fp8, str(hf_dir)), ctx)
        return {k: v for k, v in ours.items() if k in metas}

    return load_full_state(model, read, str(hf_dir), strict=strict, check=unread if strict else None)


load_hf_llama = load_hf  # the name ckpt_type "hf_llama" had; any supported HF class loads


# ---------------------------------------------------------------------------------------------------------
# export

TensorSource = Callable[[list[str]], Mapping[str, torch.Tensor]]


def model_shapes(cfg: Any) -> dict[str, torch.Tensor]:
    """Our parameter names → meta tensors of the full model of `cfg` (its state_dict order: layer by layer), from
    the family's spec (ModelSpec.parameter_shapes)."""
    from ..model import model_args_from_config

    return get_model_spec(cfg.model_type).parameter_shapes(model_args_from_config(cfg))


def export_adapter(cfg: Any, arch: Optional[str] = None) -> StateDictAdapter:
    """The family adapter that writes HF class `arch` ("llama" (default where the family has a Llama form),
    "internlm", "internlm2", "native": the family's own, e.g. MixtralForCausalLM)."""
    spec = get_model_spec(cfg.model_type)
    native = spec.adapters.get("hf")
    if arch is None and "hf_llama" not in spec.adapters and native is not None \
            and "LlamaForCausalLM" not in native.architectures:
        return native  # a family without a Llama form (mixture of experts) exports its own class
    if arch in (None, "llama"):
        return spec.adapters["hf_llama"] if "hf_llama" in spec.adapters else find_adapter(
            cfg.model_type, "hf", "LlamaForCausalLM")
    if arch == "native":
        return spec.adapters["hf"]
    classes = hf_classes()
    if arch not in classes:
        raise CheckpointError(f"Hugging Face class {arch!r}: expected native or one of {', '.join(classes)}")
    return find_adapter(cfg.model_type, "hf", classes[arch], where="export: ")


def export_hf(out_dir: str | os.PathLike, cfg: Any, source: Mapping[str, torch.Tensor] | TensorSource,
              dtype: Optional[str] = None, max_shard_size: str | int = "5GB", tokenizer: Optional[str] = "config",
              progress: Optional[Callable[[str], None]] = None, arch: Optional[str] = None) -> list[Path]:
    """Write a Hugging Face folder for the model of `cfg` (our Config) and return the files written.

    source: our full state dict, or a function returning the tensors of a list of our names (one layer group at a
    time, so that a checkpoint need not fit in memory at once).
    dtype: "float32", "bfloat16" or "float16"; default the run's `model.dtype` (fp32 for fp32/tf32 runs).
    tokenizer: "config" (the run's `tokenizer` key), None (no tokenizer files), or a tokenizer spec.
    arch: the HF class: "llama" (LlamaForCausalLM, default), "internlm", "internlm2", or "native" (the family's).
    """
    from ..model import model_args_from_config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype or resolve_precision(cfg.model.dtype, "cpu").export_name
    if dtype not in DTYPES:
        raise CheckpointError(f"export dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    tdtype = DTYPES[dtype]
    adapter = export_adapter(cfg, arch)
    conf = adapter.foreign_config(cfg.model_inputs(), dtype, {})  # type: ignore[misc]  # refuses what the class cannot hold early
    shapes = model_shapes(cfg)
    ctx = context(model_args_from_config(cfg))
    plan = groups(shapes)
    owner: dict[str, str] = {}  # foreign name → the group producing it (a tied output produces nothing new)
    nbytes: dict[str, int] = {}
    for key, names in plan.items():
        for f, t in adapter.to_foreign({n: shapes[n] for n in names}, ctx).items():
            if f not in owner:
                owner[f] = key
                nbytes[f] = t.numel() * torch.empty((), dtype=tdtype).element_size()

    if isinstance(source, Mapping):
        sd = source
        missing = [n for n in shapes if n not in sd]
        if missing:
            raise CheckpointError(f"state dict lacks {len(missing)} parameter(s), e.g. {missing[:3]}")

        def load_ours(names: list[str]) -> Mapping[str, torch.Tensor]:
            return {n: sd[n] for n in names}
    else:
        load_ours = source

    def load_shard(foreign_names: list[str]) -> dict[str, torch.Tensor]:
        shard: dict[str, torch.Tensor] = {}
        for key in dict.fromkeys(owner[f] for f in foreign_names):
            names = plan[key]
            got = load_ours(names)
            for n in names:
                if n not in got:
                    raise CheckpointError(f"checkpoint lacks parameter {n}")
                if tuple(got[n].shape) != tuple(shapes[n].shape):
                    raise CheckpointError(f"checkpoint parameter {n} has shape {tuple(got[n].shape)}, the config's "
                                          f"model expects {tuple(shapes[n].shape)}")
            full = {n: got[n].detach().to(device="cpu", dtype=tdtype) for n in names}
            shard.update({f: t.contiguous() for f, t in adapter.to_foreign(full, ctx).items() if f in foreign_names})
        return shard

    tok_spec = cfg.tokenizer if tokenizer == "config" else tokenizer
    tok = write_tokenizer_files(tok_spec, out, cfg.data.seq_len)
    files = write_safetensors_shards(list(owner), nbytes, load_shard, out, parse_size(max_shard_size), progress)
    ids = tok.special_ids
    conf = adapter.foreign_config(cfg.model_inputs(), dtype, ids)  # type: ignore[misc]
    (out / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    gen = {"_from_model_config": True, **{k: v for k, v in ids.items() if v is not None}}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if progress is not None:
        progress(tok.note)
    return [out / "config.json", out / "generation_config.json", *files, *tok.files]


# ---------------------------------------------------------------------------------------------------------
# reading the model out of a checkpoint (no process group needed)

@dataclass
class DCPModel:
    """Where the model lives inside one DCP checkpoint: its folder, key prefix and tensor metadata."""

    path: Path
    prefix: str
    tensors: dict  # our name → TensorStorageMetadata (global size and dtype)

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Read the full (unsharded) tensors of `names` in a single process, whatever layout saved them."""
        import torch.distributed.checkpoint as dcp

        missing = [n for n in names if n not in self.tensors]
        if missing:
            raise CheckpointError(f"{self.path}: checkpoint has no {self.prefix}{missing[0]}")
        sd = {self.prefix + n: torch.empty(tuple(self.tensors[n].size), dtype=self.tensors[n].properties.dtype)
              for n in names}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load(sd, storage_reader=SafeFileSystemReader(str(self.path)), planner=SafeLoadPlanner(),
                     no_dist=True)
        return {n: sd[self.prefix + n] for n in names}


def find_dcp_model(folder: str | os.PathLike, names: list[str]) -> DCPModel:
    """The model state inside one DCP checkpoint folder: the key prefix under which every one of our parameter
    `names` is stored ("model." in CheckpointManager's checkpoints; optimizer state names end otherwise)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = Path(folder)
    meta = read_dcp_metadata(folder)
    keys = {k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    probe = names[0]
    prefixes = [k[: -len(probe)] for k in keys if k.endswith(probe)]
    candidates = [p for p in prefixes if all(p + n in keys for n in names)]
    if not candidates:
        raise CheckpointError(f"{folder}: the checkpoint holds no model weights of this config (no key prefix "
                              f"under which {probe} and the model's other {len(names) - 1} parameters are stored)")
    if len(candidates) > 1:
        raise CheckpointError(f"{folder}: several model states in one checkpoint (key prefixes "
                              f"{', '.join(repr(c) for c in candidates)})")
    prefix = candidates[0]
    return DCPModel(folder, prefix, {n: keys[prefix + n] for n in names})


def export_checkpoint(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, cfg: Any = None,
                      dtype: Optional[str] = None, max_shard_size: str | int = "5GB",
                      tokenizer: Optional[str] = "config", allow_incomplete: bool = False,
                      progress: Optional[Callable[[str], None]] = None, arch: Optional[str] = None) -> list[Path]:
    """Convert an internlm-core checkpoint (any layout; a local folder or s3://) into a Hugging Face folder."""
    with local_checkpoint(ckpt_dir, allow_incomplete) as (folder, which):
        if progress is not None:
            progress(which)
        cfg = cfg if cfg is not None else checkpoint_config(folder)
        model = find_dcp_model(folder, list(model_shapes(cfg)))
        if progress is not None:
            cls = export_adapter(cfg, arch).architectures[0]
            progress(f"model state: key prefix {model.prefix!r}, {len(model.tensors)} tensors; "
                     f"{cfg.model_type} -> {cls}")
        return export_hf(out_dir, cfg, model.load, dtype=dtype, max_shard_size=max_shard_size, tokenizer=tokenizer,
                         progress=progress, arch=arch)

