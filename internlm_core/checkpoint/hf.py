"""Hugging Face Llama interchange: export our checkpoints as `LlamaForCausalLM` folders, import Llama folders.

The names and config.json of each model family are in hf_names.py, safetensors reading and writing in
safetensors_io.py, the tokenizer files in tokenizer_export.py; which checkpoint a path names in catalog.py.

Import (`load_hf_llama`, ckpt_type "hf_llama") fills a built model, plain, FSDP2 / tensor-parallel or one pipeline
stage. Export reads the model part of a DCP checkpoint (any data/tensor/pipeline layout: DCP stores global tensors)
one safetensors shard at a time, so peak memory is about one shard, not the whole model.
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
from .catalog import checkpoint_config, local_checkpoint
from .hf_names import (_MARKER_KEY, config_from_hf, expected_parameter_names, from_hf_state_dict, hf_config,
                       ours_to_hf_name)
from .safe_dcp import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata
from .safetensors_io import hf_safetensors_files, parse_size, read_hf_tensors, write_safetensors_shards
from .tokenizer_export import write_tokenizer_files

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CONFIG_DTYPE_NAMES = {"torch.float32": "float32", "torch.tf32": "float32", "torch.bfloat16": "bfloat16",
                       "torch.float16": "float16"}


# ---------------------------------------------------------------------------------------------------------
# import into a model

def _is_distributed_model(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def load_hf_llama(model: torch.nn.Module, hf_dir: str | os.PathLike, strict: bool = True) -> list[str]:
    """Load the Llama weights of `hf_dir` (safetensors) into our `model`; returns the parameter names loaded.

    `model` may be a plain module, an FSDP2 / tensor-parallel (DTensor) model, or one pipeline stage: only the
    parameters the model holds are read (a stage's layers keep their global names). Shapes are checked against
    the model's full (global) shapes; with `strict`, every parameter of the model must be in the folder.
    DTensor models are filled with `torch.distributed.checkpoint.state_dict.set_model_state_dict`
    (full_state_dict=True, broadcast_from_rank0=True): rank 0 reads the files, every rank receives its shards.
    """
    hf_cfg = config_from_hf(hf_dir)
    tie = hf_cfg["tie_word_embeddings"]
    args = getattr(model, "args", None)
    if args is not None:
        ours = {"num_layers": args.num_layers, "hidden_size": args.hidden_size, "num_attention_heads": args.num_heads,
                "num_kv_attention_heads": args.num_kv_heads, "vocab_size": args.vocab_size,
                "intermediate_size": args.ffn_width, "qkv_bias": bool(args.qkv_bias),
                "tie_word_embeddings": bool(args.tie_word_embeddings)}
        diff = [f"{k}: model {v} vs {hf_dir} {hf_cfg[k]}" for k, v in ours.items() if hf_cfg[k] != v]
        if diff:
            raise CheckpointError(f"the model does not match the Hugging Face config ({'; '.join(diff)}); "
                                  f"set these model keys (internlm_core.checkpoint.hf_names.config_from_hf reads them)")
    target = {k: v for k, v in model.state_dict().items()}
    wanted_hf = {}
    for name in target:
        if tie and name == "output.weight":
            continue
        wanted_hf[ours_to_hf_name(name)] = name
    if tie and "output.weight" in target and "tok_embeddings.weight" not in target:  # a last pipeline stage
        wanted_hf["model.embed_tokens.weight"] = "output.weight"
    available = hf_safetensors_files(hf_dir)
    missing = [n for n in wanted_hf if n not in available]
    if missing and strict:
        raise CheckpointError(f"{hf_dir}: missing {len(missing)} tensor(s) the model needs, e.g. "
                              f"{', '.join(missing[:3])}")
    present = [n for n in wanted_hf if n in available]

    distributed = _is_distributed_model(model)
    import torch.distributed as dist

    read_here = not distributed or not dist.is_initialized() or dist.get_rank() == 0
    hf_tensors = read_hf_tensors(hf_dir, present) if read_here else {}
    sd = from_hf_state_dict(hf_tensors, tie_word_embeddings=tie)
    sd = {k: v for k, v in sd.items() if k in target}
    for name, t in sd.items():
        ref = target[name]
        if tuple(t.shape) != tuple(ref.shape):
            src = "model.embed_tokens.weight" if (tie and name == "output.weight") else ours_to_hf_name(name)
            raise CheckpointError(f"{hf_dir}: {src} has shape {tuple(t.shape)}, the model's {name} has "
                                  f"{tuple(ref.shape)}")
        sd[name] = t.to(ref.dtype)
    if distributed:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=dist.is_initialized(), strict=strict)
        set_model_state_dict(model, sd, options=opts)
    else:
        result = model.load_state_dict(sd, strict=False)
        if strict and result.missing_keys:
            raise CheckpointError(f"{hf_dir}: not loaded into the model: {result.missing_keys[:3]}")
    loaded = {wanted_hf[n] for n in present}
    if tie and "model.embed_tokens.weight" in present and "output.weight" in target:
        loaded.add("output.weight")
    return sorted(loaded)


# ---------------------------------------------------------------------------------------------------------
# export

TensorSource = Callable[[list[str]], Mapping[str, torch.Tensor]]


def _model_shapes(cfg: Any) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Our parameter names → (shape, dtype) of the full model of `cfg`, built on the meta device."""
    from ..model import build_model

    model = build_model(cfg, "meta")
    return {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}


def export_hf(out_dir: str | os.PathLike, cfg: Any, source: Mapping[str, torch.Tensor] | TensorSource,
              dtype: Optional[str] = None, max_shard_size: str | int = "5GB", tokenizer: Optional[str] = "config",
              progress: Optional[Callable[[str], None]] = None) -> list[Path]:
    """Write a Hugging Face Llama folder for the model of `cfg` (our Config) and return the files written.

    source: our full state dict, or a function returning the tensors of a list of our names (one shard at a
    time, so that a checkpoint need not fit in memory at once).
    dtype: "float32", "bfloat16" or "float16"; default the run's `model.dtype` (fp32 for fp32/tf32 runs).
    tokenizer: "config" (the run's `tokenizer` key), None (no tokenizer files), or a tokenizer spec.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype or _CONFIG_DTYPE_NAMES.get(cfg.model.dtype, "float32")
    if dtype not in DTYPES:
        raise CheckpointError(f"export dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    tdtype = DTYPES[dtype]
    tie = bool(cfg.model.tie_word_embeddings)
    shapes = _model_shapes(cfg)
    ours_names = expected_parameter_names(cfg.model.num_layers, bool(cfg.model.qkv_bias), tie)
    unknown = sorted(set(shapes) - set(ours_names) - ({"output.weight"} if tie else set()))
    if unknown or set(ours_names) - set(shapes):
        raise CheckpointError(f"model of {cfg.model_type} has parameters the Llama export does not know: "
                              f"{unknown or sorted(set(ours_names) - set(shapes))}")
    hf_of = {n: ours_to_hf_name(n) for n in ours_names}
    ours_of = {v: k for k, v in hf_of.items()}
    nbytes = {hf_of[n]: shapes[n][0].numel() * torch.empty((), dtype=tdtype).element_size() for n in ours_names}

    if isinstance(source, Mapping):
        sd = source
        missing = [n for n in ours_names if n not in sd]
        if missing:
            raise CheckpointError(f"state dict lacks {len(missing)} parameter(s), e.g. {missing[:3]}")

        def load_ours(names: list[str]) -> Mapping[str, torch.Tensor]:
            return {n: sd[n] for n in names}
    else:
        load_ours = source

    def load_shard(hf_names: list[str]) -> dict[str, torch.Tensor]:
        names = [ours_of[h] for h in hf_names]
        got = load_ours(names)
        shard = {}
        for n in names:
            if n not in got:
                raise CheckpointError(f"checkpoint lacks parameter {n}")
            t = got[n]
            if tuple(t.shape) != tuple(shapes[n][0]):
                raise CheckpointError(f"checkpoint parameter {n} has shape {tuple(t.shape)}, the config's model "
                                      f"expects {tuple(shapes[n][0])}")
            shard[hf_of[n]] = t.detach().to(device="cpu", dtype=tdtype)
        return shard

    tok_spec = cfg.tokenizer if tokenizer == "config" else tokenizer
    tok = write_tokenizer_files(tok_spec, out, cfg.data.seq_len)
    files = write_safetensors_shards([hf_of[n] for n in ours_names], nbytes, load_shard, out,
                                     parse_size(max_shard_size), progress)
    ids = tok.special_ids
    conf = hf_config(cfg, dtype, ids)
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


def find_dcp_model(folder: str | os.PathLike) -> DCPModel:
    """The model state inside one DCP checkpoint folder, found by its parameter names.

    A tensor key ending in `layers.0.attention.wq.weight` marks the model and its key prefix ("model." in
    CheckpointManager's checkpoints); optimizer state (`...wq.weight.exp_avg`) never ends like that.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = Path(folder)
    meta = read_dcp_metadata(folder)
    keys = {k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    candidates = []
    for k in keys:
        if k.endswith(_MARKER_KEY):
            prefix = k[: -len(_MARKER_KEY)]
            ours = {kk[len(prefix):]: v for kk, v in keys.items() if kk.startswith(prefix)}
            candidates.append(DCPModel(folder, prefix, {kk: v for kk, v in ours.items() if _is_model_name(kk)}))
    if not candidates:
        raise CheckpointError(f"{folder}: the checkpoint holds no model weights (no key ending in {_MARKER_KEY})")
    if len(candidates) > 1:
        raise CheckpointError(f"{folder}: several model states in one checkpoint (key prefixes "
                              f"{', '.join(repr(c.prefix) for c in candidates)})")
    return candidates[0]


def _is_model_name(name: str) -> bool:
    try:
        ours_to_hf_name(name)
        return True
    except CheckpointError:
        return False


def export_checkpoint(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, cfg: Any = None,
                      dtype: Optional[str] = None, max_shard_size: str | int = "5GB",
                      tokenizer: Optional[str] = "config", allow_incomplete: bool = False,
                      progress: Optional[Callable[[str], None]] = None) -> list[Path]:
    """Convert an internlm-core checkpoint (any layout; a local folder or s3://) into a Hugging Face Llama folder."""
    with local_checkpoint(ckpt_dir, allow_incomplete) as (folder, which):
        if progress is not None:
            progress(which)
        model = find_dcp_model(folder)
        cfg = cfg if cfg is not None else checkpoint_config(folder)
        if progress is not None:
            progress(f"model state: key prefix {model.prefix!r}, {len(model.tensors)} tensors; "
                     f"{cfg.model_type} -> LlamaForCausalLM")
        return export_hf(out_dir, cfg, model.load, dtype=dtype, max_shard_size=max_shard_size, tokenizer=tokenizer,
                         progress=progress)
