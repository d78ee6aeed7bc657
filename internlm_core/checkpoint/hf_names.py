"""Hugging Face Llama names and config of our model families (moved here verbatim from hf.py, to be lifted
into the model package): parameter names, `config.json` both ways, the key that marks the model in a checkpoint.

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
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Mapping, Optional

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


# a tensor key ending in this marks the model state inside a checkpoint
_MARKER_KEY = "layers.0.attention.wq.weight"
