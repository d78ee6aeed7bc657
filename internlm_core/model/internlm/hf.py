"""Hugging Face forms of the InternLM transformer: Llama's names (`LlamaForCausalLM`, every family of this module)
and InternLM v1's `InternLMForCausalLM` (the same names and math, its own config.json and remote code).

Names map one to one, no tensor is permuted:

    tok_embeddings.weight                          model.embed_tokens.weight
    layers.{i}.attention.w{q,k,v,o}.{weight,bias}  model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}
    layers.{i}.feed_forward.w1 (gate) / w2 (up) / w3 (down)   model.layers.{i}.mlp.{gate,up,down}_proj
    layers.{i}.attention_norm / ffn_norm           model.layers.{i}.input_layernorm / post_attention_layernorm
    norm.weight / output.weight                    model.norm.weight / lm_head.weight

Rotary embeddings need no permutation: both sides rotate halves (channel i pairs with i + head_dim/2) with
inv_freq = base ** (-2i / head_dim). transformers' LlamaAttention gives q/k/v/o all `bias=attention_bias`, which
is InternLM v1's layout (bias on wq, wk, wv and wo); InternLMForCausalLM says `bias`.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

import torch

from ...errors import CheckpointError
from ..args import ffn_width
from ..layers import YARN_OPTIONS, rope_scaling_kind
from ..spec import AdapterContext, StateDictAdapter

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
    ("attention.q_norm", "self_attn.q_norm"),  # model.qk_norm (Qwen3's names)
    ("attention.k_norm", "self_attn.k_norm"),
)
_TOP_MAP = (
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
)
_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
EMBED = "model.embed_tokens.weight"


def ours_to_llama_name(name: str) -> str:
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


def llama_to_ours_name(name: str) -> str:
    """`model.layers.3.mlp.gate_proj.weight` → `layers.3.feed_forward.w1.weight` (CheckpointError if unknown)."""
    for ours, hf in _TOP_MAP:
        if name == hf:
            return ours
    m = _HF_LAYER.match(name)
    if m:
        for ours, hf in _LAYER_MAP:
            if m.group(2) == hf:
                return f"layers.{m.group(1)}.{ours}.{m.group(3)}"
    raise CheckpointError(f"Hugging Face tensor {name!r} has no counterpart in internlm-core's model (expected "
                          f"model.embed_tokens, model.layers.N.{{self_attn,mlp,*_layernorm}}, model.norm, lm_head)")


def llama_to_hf(sd: Mapping[str, torch.Tensor], ctx: AdapterContext) -> dict[str, torch.Tensor]:
    """Our names → HF Llama names. Tied embeddings: HF saves the embedding only (a lone tied output gives it)."""
    tie = bool(ctx.args.tie_word_embeddings)
    out = {}
    for k, v in sd.items():
        if tie and k == "output.weight":
            if "tok_embeddings.weight" not in sd:
                out[EMBED] = v
            continue
        out[ours_to_llama_name(k)] = v
    return out


def llama_from_hf(hf: Mapping[str, torch.Tensor], ctx: AdapterContext) -> dict[str, torch.Tensor]:
    """HF Llama names → ours; with tied embeddings `output.weight` is the embedding matrix."""
    out = {llama_to_ours_name(k): v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}
    if ctx.args.tie_word_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


# ---- config.json ---------------------------------------------------------------------------------------------

_ROPE_EXTRA = {"linear": ("factor",), "dynamic": ("factor",),
               "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
               "yarn": ("factor", "original_max_position_embeddings")}  # and those of YARN_OPTIONS it states


def rope_config(m: Any, seq_len: int) -> dict:
    """config.json's rotary keys of `model` (rope_base, rope_scaling): rope_theta, transformers 5's
    rope_parameters, transformers 4's rope_scaling, and max_position_embeddings (dynamic NTK scales beyond it, so
    it is the original length there; the training length otherwise)."""
    kind = rope_scaling_kind(m.rope_scaling)
    extra = {k: m.rope_scaling[k] for k in _ROPE_EXTRA.get(kind, ())}
    if kind == "yarn":
        extra.update({k: m.rope_scaling[k] for k in YARN_OPTIONS if m.rope_scaling.get(k) is not None})
    length = seq_len
    if kind == "dynamic":
        length = int(m.rope_scaling.get("original_max_position_embeddings") or seq_len)
    return {"rope_theta": float(m.rope_base), "max_position_embeddings": length,
            "rope_parameters": {"rope_type": kind, "rope_theta": float(m.rope_base), **extra},
            "rope_scaling": {"rope_type": kind, **extra} if kind != "default" else None}


def rope_from_config(c: Mapping, where: str) -> dict:
    """Our rope_base and rope_scaling from a config.json (transformers 5's rope_parameters or 4's rope_scaling and
    rope_theta); kinds the rotary tables do not compute are a CheckpointError."""
    params = dict(c.get("rope_scaling") or c.get("rope_parameters") or {})
    base = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    kind = str(params.get("rope_type") or params.get("type") or "default")
    if kind == "default":
        return {"rope_base": base, "rope_scaling": None}
    if kind not in _ROPE_EXTRA:
        raise CheckpointError(f"{where}: rope scaling {kind!r} ({params}) is not implemented by internlm-core's "
                              f"rotary embedding (linear, dynamic, llama3 and yarn are)")
    if kind in ("llama3", "yarn") and params.get("original_max_position_embeddings") is None:
        # transformers' standardize_rope_params: the config's own key, else max_position_embeddings
        params["original_max_position_embeddings"] = (c.get("original_max_position_embeddings") or
                                                      c.get("max_position_embeddings"))
    if kind == "yarn" and params.get("factor") is None and params.get("original_max_position_embeddings"):
        params["factor"] = float(_get(c, "max_position_embeddings", where)) / params["original_max_position_embeddings"]
    missing = [k for k in _ROPE_EXTRA[kind] if params.get(k) is None]
    if missing:
        raise CheckpointError(f"{where}: {kind} rope scaling without {', '.join(missing)}")
    scaling = {("rope_type" if kind in ("llama3", "yarn") else "type"): kind,
               **{k: params[k] for k in _ROPE_EXTRA[kind]}}
    if kind == "yarn":
        scaling.update({k: params[k] for k in YARN_OPTIONS if params.get(k) is not None})
    if kind == "dynamic":  # transformers scales beyond max_position_embeddings
        scaling["original_max_position_embeddings"] = int(_get(c, "max_position_embeddings", where))
    return {"rope_base": base, "rope_scaling": scaling}


def refuse_options(m: Any, hf_class: str, allowed: tuple[str, ...] = ()) -> None:
    """CheckpointError for the shared block's options `hf_class` cannot hold (all but `allowed` of qk_norm,
    sliding_window, window_layers)."""
    for key in ("qk_norm", "sliding_window", "window_layers"):
        value = getattr(m, key)  # the typed field named by `key`
        if key not in allowed and value:
            raise CheckpointError(f"model.{key}={value!r}: {hf_class} has no such option; export a "
                                  f"family whose Hugging Face class has it (QWEN3 for qk_norm, MISTRAL for "
                                  f"sliding_window, QWEN2 / QWEN3 for window_layers)")


def _common_config(cfg: Any, torch_dtype: str, special_ids: Optional[Mapping[str, Optional[int]]]) -> dict:
    m = cfg.model
    if m.apply_post_layer_norm:
        raise CheckpointError("model.apply_post_layer_norm=True: post-norm blocks have no Hugging Face "
                              "equivalent; only pre-norm models can be exported")
    if m.norm_type != "rmsnorm":
        raise CheckpointError(f"model.norm_type={m.norm_type!r}: only rmsnorm models export to Hugging Face")
    ids = dict(special_ids or {})
    return {
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "intermediate_size": ffn_width(m),
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_kv_attention_heads or m.num_attention_heads, "hidden_act": "silu",
        "initializer_range": m.init_std, "rms_norm_eps": m.layer_norm_epsilon, **rope_config(m, cfg.seq_len),
        "tie_word_embeddings": bool(m.tie_word_embeddings), "bos_token_id": ids.get("bos_token_id"),
        "eos_token_id": ids.get("eos_token_id"), "pad_token_id": ids.get("pad_token_id"), "use_cache": True,
        "torch_dtype": torch_dtype,
    }


def llama_config(cfg: Any, torch_dtype: str = "float32",
                 special_ids: Optional[Mapping[str, Optional[int]]] = None) -> dict:
    """The `config.json` of a `LlamaForCausalLM` equivalent to `cfg` (our Config); rope_theta is written at the top
    level (transformers 4.x, vLLM) and in `rope_parameters` (transformers 5)."""
    refuse_options(cfg.model, "LlamaForCausalLM")
    c = _common_config(cfg, torch_dtype, special_ids)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **c, "head_dim": head_dim(cfg.model),
            "attention_bias": bool(cfg.model.qkv_bias), "attention_dropout": 0.0, "mlp_bias": False,
            "pretraining_tp": 1}


def head_dim(m: Any) -> int:
    """Channels per head of `model` (model.head_dim, default hidden_size / num_attention_heads)."""
    return int(m.head_dim or m.hidden_size // m.num_attention_heads)


def internlm_config(cfg: Any, torch_dtype: str = "float32",
                    special_ids: Optional[Mapping[str, Optional[int]]] = None) -> dict:
    """The `config.json` of an `InternLMForCausalLM` (InternLM v1's remote code, model_type "internlm")."""
    refuse_options(cfg.model, "InternLMForCausalLM")
    kind = rope_scaling_kind(cfg.model.rope_scaling)
    if kind not in ("default", "dynamic"):
        raise CheckpointError(f"model.rope_scaling={cfg.model.rope_scaling}: InternLMForCausalLM's config holds "
                              "dynamic NTK only; export it as Llama (--hf-arch llama)")
    c = _common_config(cfg, torch_dtype, special_ids)
    del c["rope_parameters"]  # transformers' key; InternLM's remote code reads `rotary`
    if c["num_key_value_heads"] != c["num_attention_heads"]:
        raise CheckpointError("InternLMForCausalLM has no grouped-query attention; export this model as Llama "
                              "(--hf-arch llama) or InternLM2")
    del c["num_key_value_heads"]
    return {"architectures": ["InternLMForCausalLM"], "model_type": "internlm",
            "auto_map": {"AutoConfig": "configuration_internlm.InternLMConfig",
                         "AutoModel": "modeling_internlm.InternLMForCausalLM",
                         "AutoModelForCausalLM": "modeling_internlm.InternLMForCausalLM"},
            **c, "bias": bool(cfg.model.qkv_bias), "rope_scaling": None,
            "rotary": {"base": float(cfg.model.rope_base), "type": "origin"} if kind == "default" else
            {"base": float(cfg.model.rope_base), "type": "dynamic", "scaling_factor": cfg.model.rope_scaling["factor"]}}


def _get(c: Mapping, key: str, where: str) -> Any:
    try:
        return c[key]
    except KeyError:
        raise CheckpointError(f"{where}: missing key {key!r}") from None


def _shape_keys(c: Mapping, where: str) -> dict:
    hidden, heads = int(_get(c, "hidden_size", where)), int(_get(c, "num_attention_heads", where))
    if c.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act {c.get('hidden_act')!r}; internlm-core's FFN is SwiGLU (silu)")
    dim = c.get("head_dim")
    return {"head_dim": int(dim) if dim is not None else hidden // heads,  # Qwen3's 128 at any width
        "num_layers": int(_get(c, "num_hidden_layers", where)), "hidden_size": hidden,
        "num_attention_heads": heads, "num_kv_attention_heads": int(c.get("num_key_value_heads") or heads),
        "vocab_size": int(_get(c, "vocab_size", where)), "intermediate_size": int(_get(c, "intermediate_size", where)),
        "layer_norm_epsilon": float(c.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(c.get("tie_word_embeddings", False)),
        "qk_norm": False, "sliding_window": None, "window_layers": None,  # the Llama block's (no q/k norm, no window)
    }


def check_rope(scaling: Any, where: str, dynamic_ok: bool) -> None:
    """Refuse rotary scalings our rotary embedding does not compute (dynamic NTK, where the family's modelling code
    applies it only beyond max_position_embeddings, is accepted when `dynamic_ok`)."""
    if not scaling:
        return
    kind = str(scaling.get("rope_type") or scaling.get("type") or "default") if isinstance(scaling, Mapping) else "?"
    if kind in ("default", "origin") or (dynamic_ok and kind == "dynamic"):
        return
    raise CheckpointError(f"{where}: rope scaling ({scaling}) is not implemented by internlm-core's rotary "
                          f"embedding; only the original rotary embedding can be loaded")


def config_from_llama(c: Mapping, where: str = "config.json") -> dict:
    """The `model` keys of a Llama config.json (rope scaling other than linear / dynamic / llama3, an MLP bias or
    another activation refused)."""
    out = _shape_keys(c, where)
    out["qkv_bias"] = bool(c.get("attention_bias", False))
    out.update(rope_from_config(c, where))
    if c.get("mlp_bias"):
        raise CheckpointError(f"{where}: mlp_bias=true; internlm-core's feed-forward has no bias")
    return out


def config_from_internlm(c: Mapping, where: str = "config.json") -> dict:
    """The `model` keys of an InternLMForCausalLM config.json (`bias`, `rotary` = {base, type, scaling_factor}):
    type "dynamic" is its remote code's dynamic NTK beyond max_position_embeddings (scaling_factor 1.0 by
    default), our rope_scaling of type dynamic."""
    out = _shape_keys(c, where)
    out["qkv_bias"] = bool(c.get("bias", True))
    rotary = c.get("rotary") or {}
    check_rope(c.get("rope_scaling") or ({"type": rotary["type"]} if "type" in rotary else None), where,
               dynamic_ok=True)
    out["rope_base"], out["rope_scaling"] = float(rotary.get("base", c.get("rope_theta", 10000.0))), None
    if rotary.get("type") == "dynamic" and not c.get("rope_scaling"):
        out["rope_scaling"] = {"type": "dynamic", "factor": float(rotary.get("scaling_factor", 1.0)),
                               "original_max_position_embeddings": int(c.get("max_position_embeddings", 2048))}
    return out


LLAMA_HF = StateDictAdapter(format="hf", to_foreign=llama_to_hf, from_foreign=llama_from_hf,
                            foreign_config=llama_config, config_from_foreign=config_from_llama,
                            architectures=("LlamaForCausalLM",), hf_model_types=("llama",),
                            description="Hugging Face LlamaForCausalLM")
INTERNLM_HF = StateDictAdapter(format="hf", to_foreign=llama_to_hf, from_foreign=llama_from_hf,
                               foreign_config=internlm_config, config_from_foreign=config_from_internlm,
                               architectures=("InternLMForCausalLM",), hf_model_types=("internlm",),
                               description="Hugging Face InternLMForCausalLM (InternLM v1, remote code)")
