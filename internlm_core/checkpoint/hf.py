"""Hugging Face Llama interchange: export our checkpoints as `LlamaForCausalLM` folders, import Llama folders.

Every model family here exports to the same Hugging Face class, `LlamaForCausalLM` (model_type "llama"):

| ours (model_type)     | Hugging Face config                                  |
|-----------------------|------------------------------------------------------|
| INTERNLM (v1)         | attention_bias=true (bias on q/k/v **and** o_proj)   |
| INTERNLM2, LLAMA      | attention_bias=false, num_key_value_heads for GQA    |

transformers' LlamaAttention gives q/k/v/o_proj all `bias=config.attention_bias`, which is exactly InternLM v1's
layout (bias on wq, wk, wv and wo). Post-norm blocks (`model.apply_post_layer_norm=True`) have no Llama equivalent
and are refused. Parameter names map one to one, no tensor is permuted:

    tok_embeddings.weight                      model.embed_tokens.weight
    layers.{i}.attention.w{q,k,v,o}.{weight,bias}  model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}
    layers.{i}.feed_forward.w1 (gate)          model.layers.{i}.mlp.gate_proj
    layers.{i}.feed_forward.w2 (up)            model.layers.{i}.mlp.up_proj
    layers.{i}.feed_forward.w3 (down)          model.layers.{i}.mlp.down_proj
    layers.{i}.attention_norm / ffn_norm       model.layers.{i}.input_layernorm / post_attention_layernorm
    norm.weight / output.weight                model.norm.weight / lm_head.weight

Rotary embeddings need no permutation either: both sides use rotate-half (the first half of each head's channels
pairs with the second half) with inv_freq = base ** (-2i / head_dim). (Meta's original Llama weights use
interleaved pairs, which is why HF's own Llama converter permutes wq/wk; ours already has HF's layout.)

Export reads the model part of a DCP checkpoint (any data/tensor/pipeline layout: DCP stores global tensors) one
safetensors shard at a time, so peak memory is about one shard, not the whole model.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

import torch

from ..errors import CheckpointError

# ---------------------------------------------------------------------------------------------------------
# names

_LAYER_MAP = (
    ("attention.wq", "self_attn.q_proj"),
    ("attention.wk", "self_attn.k_proj"),
    ("attention.wv", "self_attn.v_proj"),
    ("attention.wo", "self_attn.o_proj"),
    ("feed_forward.w1", "mlp.gate_proj"),
    ("feed_forward.w2", "mlp.up_proj"),
    ("feed_forward.w3", "mlp.down_proj"),
    ("attention_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
)
_TOP_MAP = (
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
)
_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CONFIG_DTYPE_NAMES = {"torch.float32": "float32", "torch.tf32": "float32", "torch.bfloat16": "bfloat16",
                       "torch.float16": "float16"}


def ours_to_hf_name(name: str) -> str:
    """`layers.3.attention.wq.weight` → `model.layers.3.self_attn.q_proj.weight` (CheckpointError if unknown)."""
    for ours, hf in _TOP_MAP:
        if name == ours:
            return hf
    m = _OURS_LAYER.match(name)
    if m:
        for ours, hf in _LAYER_MAP:
            if m.group(2) == ours:
                return f"model.layers.{m.group(1)}.{hf}.{m.group(3)}"
    raise CheckpointError(f"parameter {name!r} has no Hugging Face Llama equivalent")


def hf_to_ours_name(name: str) -> str:
    """`model.layers.3.mlp.gate_proj.weight` → `layers.3.feed_forward.w1.weight` (CheckpointError if unknown)."""
    for ours, hf in _TOP_MAP:
        if name == hf:
            return ours
    m = _HF_LAYER.match(name)
    if m:
        for ours, hf in _LAYER_MAP:
            if m.group(2) == hf:
                return f"layers.{m.group(1)}.{ours}.{m.group(3)}"
    raise CheckpointError(f"Hugging Face tensor {name!r} has no counterpart in internlm-core's Llama model "
                          f"(expected model.embed_tokens, model.layers.N.{{self_attn,mlp,*_layernorm}}, model.norm, lm_head)")


def to_hf_state_dict(state_dict: Mapping[str, torch.Tensor], tie_word_embeddings: bool = False) -> dict[str, torch.Tensor]:
    """Our parameter names → HF Llama names (the tied `output.weight` is left out, as HF saves it)."""
    out = {}
    for k, v in state_dict.items():
        if tie_word_embeddings and k == "output.weight":
            continue
        out[ours_to_hf_name(k)] = v
    return out


def from_hf_state_dict(hf_state_dict: Mapping[str, torch.Tensor], tie_word_embeddings: bool = False) -> dict[str, torch.Tensor]:
    """HF Llama names → ours; with tied embeddings `output.weight` is the embedding matrix (HF omits lm_head)."""
    out = {hf_to_ours_name(k): v for k, v in hf_state_dict.items()
           if not k.endswith("rotary_emb.inv_freq")}  # a buffer some old exports carry; we rebuild it
    if tie_word_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def expected_parameter_names(num_layers: int, qkv_bias: bool, tie_word_embeddings: bool = False) -> list[str]:
    """Our names of every tensor of a full model, in export order (layer by layer)."""
    names = ["tok_embeddings.weight"]
    for i in range(num_layers):
        for ours, _ in _LAYER_MAP:
            names.append(f"layers.{i}.{ours}.weight")
            if qkv_bias and ours.startswith("attention.w"):
                names.append(f"layers.{i}.{ours}.bias")
    names.append("norm.weight")
    if not tie_word_embeddings:
        names.append("output.weight")
    return names


# ---------------------------------------------------------------------------------------------------------
# config.json

def hf_config(cfg: Any, torch_dtype: str = "float32", special_ids: Optional[Mapping[str, Optional[int]]] = None) -> dict:
    """The `config.json` of a `LlamaForCausalLM` equivalent to `cfg` (our Config).

    rope_theta is written both at the top level (transformers 4.x, vLLM) and in `rope_parameters`
    (transformers 5), so every reader finds it.
    """
    from ..model import ffn_width

    m = cfg.model
    if m.apply_post_layer_norm:
        raise CheckpointError("model.apply_post_layer_norm=True: post-norm blocks have no Hugging Face Llama "
                              "equivalent; only pre-norm models can be exported")
    if m.norm_type != "rmsnorm":
        raise CheckpointError(f"model.norm_type={m.norm_type!r}: only rmsnorm models export to Llama")
    ids = dict(special_ids or {})
    head_dim = m.hidden_size // m.num_attention_heads
    kv = m.num_kv_attention_heads or m.num_attention_heads
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": ffn_width(m),
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.data.seq_len,
        "initializer_range": m.init_std,
        "rms_norm_eps": m.layer_norm_epsilon,
        "rope_theta": float(m.rope_base),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(m.rope_base)},
        "attention_bias": bool(m.qkv_bias),
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": bool(m.tie_word_embeddings),
        "bos_token_id": ids.get("bos_token_id"),
        "eos_token_id": ids.get("eos_token_id"),
        "pad_token_id": ids.get("pad_token_id"),
        "use_cache": True,
        "pretraining_tp": 1,
        "torch_dtype": torch_dtype,
    }


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from None


def config_from_hf(hf_dir: str | os.PathLike) -> dict:
    """The `model` config keys of the Llama in `hf_dir`/config.json, in our names.

    Returns num_layers, hidden_size, num_attention_heads, num_kv_attention_heads, vocab_size, intermediate_size,
    layer_norm_epsilon, rope_base, tie_word_embeddings and qkv_bias. Features our model does not implement
    (rope scaling, MLP bias, a head_dim other than hidden_size / heads, another activation) are refused with a
    CheckpointError rather than loaded into a model that would compute something else.
    """
    path = Path(hf_dir) / "config.json"
    c = _read_json(path)
    mt = c.get("model_type")
    if mt != "llama":
        raise CheckpointError(f"{path}: model_type {mt!r}; only Hugging Face Llama folders (model_type \"llama\") "
                              f"can be loaded with ckpt_type=\"hf_llama\"")
    try:
        hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        out = {
            "num_layers": int(c["num_hidden_layers"]),
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "num_kv_attention_heads": int(c.get("num_key_value_heads") or heads),
            "vocab_size": int(c["vocab_size"]),
            "intermediate_size": int(c["intermediate_size"]),
            "layer_norm_epsilon": float(c.get("rms_norm_eps", 1e-6)),
            "tie_word_embeddings": bool(c.get("tie_word_embeddings", False)),
            "qkv_bias": bool(c.get("attention_bias", False)),
        }
    except KeyError as e:
        raise CheckpointError(f"{path}: missing key {e.args[0]!r}") from None
    rope = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling")
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if scaling or rope_type != "default":
        raise CheckpointError(f"{path}: rope scaling ({scaling or rope}) is not implemented by internlm-core's "
                              f"rotary embedding; only rope_type 'default' can be loaded")
    out["rope_base"] = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    if c.get("mlp_bias"):
        raise CheckpointError(f"{path}: mlp_bias=true; internlm-core's feed-forward has no bias")
    if c.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act {c.get('hidden_act')!r}; internlm-core's FFN is SwiGLU (silu)")
    head_dim = c.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != hidden:
        raise CheckpointError(f"{path}: head_dim {head_dim} * num_attention_heads {heads} != hidden_size {hidden}; "
                              f"internlm-core derives head_dim as hidden_size / num_attention_heads")
    return out


# ---------------------------------------------------------------------------------------------------------
# safetensors folders

def parse_size(text: str | int) -> int:
    """"5GB" / "500MB" / "2GiB" / 1000 → bytes (decimal units as transformers' max_shard_size, binary for *iB)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise CheckpointError(f"max shard size {text!r}: expected a number with an optional unit, e.g. 5GB or 500MB")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(m.group(1)) * scale)


def plan_shards(sizes: Iterable[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Group names (in order) into shards of at most `max_shard_bytes` (a larger tensor gets a shard alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return [s for s in shards if s]


def write_safetensors_shards(names_in_order: list[str], nbytes: Mapping[str, int],
                             load: Callable[[list[str]], Mapping[str, torch.Tensor]], out_dir: Path,
                             max_shard_bytes: int, progress: Optional[Callable[[str], None]] = None) -> list[Path]:
    """Write HF-named tensors as `model.safetensors` or `model-0000i-of-0000n.safetensors` + index.

    `load(names)` returns the HF-named tensors of one shard (already in the output dtype), so that only one
    shard is in memory at a time.
    """
    from safetensors.torch import save_file

    shards = plan_shards(((n, nbytes[n]) for n in names_in_order), max_shard_bytes)
    paths, weight_map, total = [], {}, 0
    for i, names in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = load(names)
        missing = [n for n in names if n not in tensors]
        if missing:
            raise CheckpointError(f"tensors {missing[:3]} were not produced for shard {fname}")
        tensors = {n: tensors[n].contiguous() for n in names}
        save_file(tensors, str(out_dir / fname), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({n: fname for n in names})
        paths.append(out_dir / fname)
        if progress is not None:
            progress(f"wrote {fname} ({len(names)} tensors)")
        del tensors
    if len(shards) > 1:
        index = out_dir / "model.safetensors.index.json"
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        paths.append(index)
    return paths


def hf_safetensors_files(hf_dir: str | os.PathLike) -> dict[str, Path]:
    """HF tensor name → the safetensors file holding it (from the index, or the single model.safetensors)."""
    d = Path(hf_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        wm = _read_json(index).get("weight_map")
        if not isinstance(wm, dict):
            raise CheckpointError(f"{index}: no weight_map")
        return {k: d / v for k, v in wm.items()}
    single = d / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {k: single for k in f.keys()}
    if any(d.glob("pytorch_model*.bin")):
        raise CheckpointError(f"{d}: only pytorch_model*.bin (pickle) weights; convert them to safetensors first "
                              f"(pickles are never loaded here)")
    raise CheckpointError(f"{d}: no model.safetensors or model.safetensors.index.json")


def read_hf_tensors(hf_dir: str | os.PathLike, names: Optional[Iterable[str]] = None) -> dict[str, torch.Tensor]:
    """The HF-named tensors of a Llama folder (all, or only `names`), read from its safetensors files."""
    from safetensors import safe_open

    where = hf_safetensors_files(hf_dir)
    wanted = list(where) if names is None else list(names)
    missing = [n for n in wanted if n not in where]
    if missing:
        raise CheckpointError(f"{hf_dir}: tensor(s) {missing[:3]} not found in its safetensors files")
    by_file: dict[Path, list[str]] = {}
    for n in wanted:
        by_file.setdefault(where[n], []).append(n)
    out = {}
    for path, keys in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for k in keys:
                out[k] = f.get_tensor(k)
    return out


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
                                  f"set these model keys (internlm_core.checkpoint.hf.config_from_hf reads them)")
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
# tokenizer files

@dataclass
class TokenizerExport:
    """What `write_tokenizer_files` wrote and the special-token ids for config.json."""

    files: list[Path]
    special_ids: dict
    note: str


def _byte_tokenizer_json(add_bos: bool) -> str:
    """A `tokenizers` tokenizer.json equal to our built-in byte tokenizer: ids 0..255 are UTF-8 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers import AddedToken

    from ..data.tokenizers import BYTE_BOS, BYTE_EOS, BYTE_PAD

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins of GPT-2's byte-level BPE
    # GPT-2's bytes_to_unicode: bytes that are printable map to themselves, the rest to 256+n in order
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    if set(chars.values()) != set(alphabet):
        raise CheckpointError("tokenizers' ByteLevel alphabet differs from GPT-2's byte mapping; cannot export "
                              "the byte tokenizer")
    vocab = {chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True),
                            AddedToken("<pad>", special=True)])
    ids = {"<s>": tok.token_to_id("<s>"), "</s>": tok.token_to_id("</s>"), "<pad>": tok.token_to_id("<pad>")}
    if ids != {"<s>": BYTE_BOS, "</s>": BYTE_EOS, "<pad>": BYTE_PAD}:
        raise CheckpointError(f"byte tokenizer export: special ids came out as {ids}")
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", BYTE_BOS)])
    return tok.to_str()


def _sentencepiece_normalizer(path: Path) -> Optional[tuple[str, bool]]:
    """(normalization rule name, remove_extra_whitespaces) of a SentencePiece model; None without protobuf."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb
        proto = pb.ModelProto()
        proto.ParseFromString(path.read_bytes())
    except Exception:  # protobuf missing or an unexpected file: the note just lacks the warning
        return None
    return proto.normalizer_spec.name, bool(proto.normalizer_spec.remove_extra_whitespaces)


def write_tokenizer_files(spec: Optional[str], out_dir: str | os.PathLike, model_max_length: int,
                          add_bos: bool = True) -> TokenizerExport:
    """Write the tokenizer of a run into an HF folder.

    spec "byte": a `tokenizer.json` (byte-level BPE without merges: ids 0..255 are the UTF-8 bytes, <s> 256,
    </s> 257, <pad> 258) loadable with AutoTokenizer. A SentencePiece `.model`: copied as `tokenizer.model` with a
    LlamaTokenizer `tokenizer_config.json`. A `tokenizer.json`: copied with a PreTrainedTokenizerFast config.
    None (unknown): nothing is written and the note says so.
    """
    out = Path(out_dir)
    if spec is None:
        return TokenizerExport([], {}, "no tokenizer recorded in the run's config (key `tokenizer`): "
                                       "no tokenizer files written; pass --tokenizer to add them")
    from ..data.tokenizers import load_tokenizer

    try:
        tok = load_tokenizer(spec)
    except Exception as e:  # DataError for a missing or unreadable file
        raise CheckpointError(f"tokenizer {spec!r}: {e}") from None
    files: list[Path] = []
    common = {"model_max_length": model_max_length, "add_bos_token": add_bos, "add_eos_token": False,
              "clean_up_tokenization_spaces": False}
    if tok.name == "byte":
        (out / "tokenizer.json").write_text(_byte_tokenizer_json(add_bos))
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
               "pad_token": "<pad>", **common}
        ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
        files.append(out / "tokenizer.json")
        note = "byte tokenizer: tokenizer.json with UTF-8 byte ids 0..255, <s>=256, </s>=257, <pad>=258"
    elif spec.endswith(".json") or (Path(spec).is_dir() and (Path(spec) / "tokenizer.json").is_file()):
        src = Path(spec) / "tokenizer.json" if Path(spec).is_dir() else Path(spec)
        shutil.copyfile(src, out / "tokenizer.json")
        t = tok.tok
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **common}
        if tok.bos_id is not None:
            cfg["bos_token"] = t.id_to_token(tok.bos_id)
        if tok.eos_id is not None:
            cfg["eos_token"] = t.id_to_token(tok.eos_id)
        cfg["add_bos_token"] = False  # a tokenizer.json carries its own post-processor
        ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": None}
        files.append(out / "tokenizer.json")
        note = f"tokenizer.json copied from {src}"
    else:
        src = Path(tok.name)
        shutil.copyfile(src, out / "tokenizer.model")
        sp = tok.sp
        # the model's own normalizer decides whether "▁" is prepended (Llama's yes, InternLM's V7_sft.model no)
        prefix = sp.encode("a", out_type=str)[0].startswith("\u2581")
        cfg = {"tokenizer_class": "LlamaTokenizer", "unk_token": sp.id_to_piece(sp.unk_id()),
               "legacy": False, "add_prefix_space": prefix, "sp_model_kwargs": {}, **common}
        if tok.bos_id is not None:
            cfg["bos_token"] = sp.id_to_piece(tok.bos_id)
        if tok.eos_id is not None:
            cfg["eos_token"] = sp.id_to_piece(tok.eos_id)
        pad = sp.pad_id()
        ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": pad if pad >= 0 else None}
        files.append(out / "tokenizer.model")
        note = f"SentencePiece model copied from {src} (LlamaTokenizer, add_prefix_space={prefix})"
        norm = _sentencepiece_normalizer(src)
        if norm is not None and (norm[0] != "identity" or norm[1]):
            note += (f"; WARNING: the model normalizes text ({norm[0]}, remove_extra_whitespaces={norm[1]}), which "
                     f"transformers' LlamaTokenizer does not do: ids differ on whitespace runs and some unicode")
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    specials = {k: cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if k in cfg}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    files += [out / "tokenizer_config.json", out / "special_tokens_map.json"]
    return TokenizerExport(files, ids, note)


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

        from .safe_dcp import SafeFileSystemReader, SafeLoadPlanner

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


_MARKER_KEY = "layers.0.attention.wq.weight"


def resolve_checkpoint(path: str | os.PathLike, allow_incomplete: bool = False) -> tuple[Path, str]:
    """The local checkpoint folder to read and a line saying which it is.

    `path` is one checkpoint (it holds the COMPLETE marker) or a `save_ckpt_folder` (its newest complete
    checkpoint, snapshots included, is taken). A folder with DCP shards but no marker was interrupted while
    being written, or was not written by CheckpointManager: refused unless `allow_incomplete`.
    """
    from .manager import latest_checkpoint
    from .storage import DCP_METADATA, LocalDestination

    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint folder not found")
    dest = LocalDestination(root)
    marker = dest.read_marker("")
    if marker is not None:
        problem = dest.verify("", marker)
        if problem:
            raise CheckpointError(f"checkpoint {root} is damaged: {problem}")
        return root, f"checkpoint of step {marker['step']}: {root}"
    if (root / DCP_METADATA).is_file() or any(root.glob("*.distcp")):
        if allow_incomplete:
            return root, f"DCP folder without a completion marker (read anyway): {root}"
        raise CheckpointError(f"checkpoint {root} has no COMPLETE marker: it was interrupted while being written "
                              f"(or not written by train.py); convert an older one, or pass --allow-incomplete")
    ref = latest_checkpoint(dest)
    if ref is None:
        raise CheckpointError(f"{root}: no complete checkpoint in it (expected a folder written by train.py "
                              f"with a COMPLETE marker, or a save_ckpt_folder holding such folders)")
    folder = dest.path(ref.name)
    return folder, f"newest complete checkpoint under {root}: step {ref.step} ({ref.kind}): {folder}"


@contextlib.contextmanager
def local_checkpoint(path: str | os.PathLike, allow_incomplete: bool = False,
                     download_dir: Optional[str | os.PathLike] = None) -> Iterator[tuple[Path, str]]:
    """`resolve_checkpoint` for a local path; for `s3://bucket/prefix` (one checkpoint, or a save folder: its
    newest complete one) the checkpoint's files are downloaded into `download_dir` (default a temporary folder,
    removed afterwards). boto3 takes the endpoint and credentials from the environment, as for training."""
    from .manager import latest_checkpoint
    from .storage import parse_destination

    text = str(path)
    if "://" not in text:
        yield resolve_checkpoint(text, allow_incomplete)
        return
    dest = parse_destination(text)
    marker = dest.read_marker("")
    if marker is not None:
        name, step = "", marker["step"]
    else:
        ref = latest_checkpoint(dest)
        if ref is None:
            raise CheckpointError(f"{text}: no complete checkpoint there (a COMPLETE marker is written last)")
        name, marker, step = ref.name, ref.marker, ref.step
    problem = dest.verify(name, marker)
    if problem:
        raise CheckpointError(f"checkpoint {dest.child(name)} is damaged: {problem}")
    tmp = None if download_dir is not None else tempfile.mkdtemp(prefix="convert2hf-")
    local = Path(download_dir if download_dir is not None else tmp)
    try:
        dest.download(name, marker.get("files", {}), local)
        yield local, f"checkpoint of step {step}: {dest.child(name)} (downloaded to {local})"
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def find_dcp_model(folder: str | os.PathLike) -> DCPModel:
    """The model state inside one DCP checkpoint folder, found by its parameter names.

    A tensor key ending in `layers.0.attention.wq.weight` marks the model and its key prefix ("model." in
    CheckpointManager's checkpoints); optimizer state (`...wq.weight.exp_avg`) never ends like that.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .safe_dcp import read_dcp_metadata

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


def find_checkpoint_config(folder: str | os.PathLike) -> Any:
    """The run's Config recorded in a checkpoint: meta.json's "config" (YAML text), else config.yaml."""
    import yaml

    from ..config import build_config, load_config
    from .storage import CONFIG, META

    folder = Path(folder)
    meta = folder / META
    if meta.is_file():
        try:
            raw = json.loads(meta.read_text(encoding="utf-8")).get("config")
            raw = yaml.safe_load(raw) if isinstance(raw, str) else raw
        except (OSError, ValueError, AttributeError, yaml.YAMLError):
            raw = None
        if isinstance(raw, dict):
            return build_config(raw, source=f"{meta} (config)")
    if (folder / CONFIG).is_file():
        return load_config(folder / CONFIG)
    raise CheckpointError(f"{folder}: no run config in the checkpoint ({META} with a \"config\" entry, or "
                          f"{CONFIG}); pass --config")


def export_checkpoint(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, cfg: Any = None,
                      dtype: Optional[str] = None, max_shard_size: str | int = "5GB",
                      tokenizer: Optional[str] = "config", allow_incomplete: bool = False,
                      progress: Optional[Callable[[str], None]] = None) -> list[Path]:
    """Convert an internlm-core checkpoint (any layout; a local folder or s3://) into a Hugging Face Llama folder."""
    with local_checkpoint(ckpt_dir, allow_incomplete) as (folder, which):
        if progress is not None:
            progress(which)
        model = find_dcp_model(folder)
        cfg = cfg if cfg is not None else find_checkpoint_config(folder)
        if progress is not None:
            progress(f"model state: key prefix {model.prefix!r}, {len(model.tensors)} tensors; "
                     f"{cfg.model_type} -> LlamaForCausalLM")
        return export_hf(out_dir, cfg, model.load, dtype=dtype, max_shard_size=max_shard_size, tokenizer=tokenizer,
                         progress=progress)
