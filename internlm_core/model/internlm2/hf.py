"""InternLM2's forms: Hugging Face `InternLM2ForCausalLM` (remote code) and InternEvo's training checkpoints.

Both name the modules alike (HF adds the "model." prefix except on `output`):

    ours                                   InternLM2
    tok_embeddings.weight                  tok_embeddings.weight
    layers.{i}.attention.w{q,k,v}          layers.{i}.attention.wqkv, packed per key/value group
    layers.{i}.attention.wo                layers.{i}.attention.wo
    layers.{i}.feed_forward.w1 (gate)      layers.{i}.feed_forward.w1 (gate)
    layers.{i}.feed_forward.w2 (up)        layers.{i}.feed_forward.w3 (up)
    layers.{i}.feed_forward.w3 (down)      layers.{i}.feed_forward.w2 (down)
    layers.{i}.attention_norm / ffn_norm   the same;  norm.weight, output.weight: the same

`wqkv` rows are "(kv_heads, q_per_kv + 2, head_dim)": for each key/value group its q_per_kv query heads, then its
key head, then its value head. InternEvo's tensor-parallel shards split wqkv by whole groups (cat dim 0), wo and w2
by input (dim 1), w1/w3 and output by output (dim 0), the embedding by hidden (embed_split_hidden) or vocabulary.
InternEvo checkpoints trained with qk_interleaved=True (adapt_hf=False) keep q/k channels interleaved in pairs:
they are permuted to the rotate-half layout (ours and HF's) on load, as InternEvo's convert2hf_internlm2 does.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

import torch

from ...errors import CheckpointError
from ..internlm.hf import _common_config, _shape_keys, refuse_options, rope_from_config
from ..layers import rope_scaling_kind
from ..spec import AdapterContext, StateDictAdapter

_FFN = {"feed_forward.w1": "feed_forward.w1", "feed_forward.w2": "feed_forward.w3",
        "feed_forward.w3": "feed_forward.w2"}  # ours -> InternLM2's
_SAME = ("attention.wo", "attention_norm", "ffn_norm")
_OURS = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_THEIRS = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
# tensor-parallel concatenation dim of InternEvo's shards (None: replicated)
_TP_DIM = {"attention.wqkv": 0, "attention.wo": 1, "feed_forward.w1": 0, "feed_forward.w3": 0,
           "feed_forward.w2": 1, "attention_norm": None, "ffn_norm": None}


def pack_wqkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: Any) -> torch.Tensor:
    """wq, wk, wv (weights or biases) → InternLM2's grouped wqkv."""
    g, n, d = a.num_kv_heads, a.num_heads // a.num_kv_heads, a.head_dim
    rest = q.shape[1:]
    parts = [q.reshape(g, n, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def unpack_wqkv(w: torch.Tensor, a: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, n, d = a.num_kv_heads, a.num_heads // a.num_kv_heads, a.head_dim
    rest = w.shape[1:]
    x = w.reshape(g, n + 2, d, *rest)
    q, k, v = x[:, :n], x[:, n:n + 1], x[:, n + 1:]
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _deinterleave(x: torch.Tensor, d: int) -> torch.Tensor:
    """Rows of each head from interleaved pairs (0, 1), (2, 3), ... to halves (0, 2, 4, ..., 1, 3, 5, ...)."""
    rest = x.shape[1:]
    h = x.reshape(-1, d, *rest)
    return torch.cat([h[:, 0::2], h[:, 1::2]], dim=1).reshape(-1, *rest)


def _to_internlm2(sd: Mapping[str, torch.Tensor], a: Any) -> dict[str, torch.Tensor]:
    """Our names → InternLM2's (no prefix)."""
    out: dict[str, torch.Tensor] = {}
    layers: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for k, v in sd.items():
        m = _OURS.match(k)
        if not m:
            if k == "output.weight" and a.tie_word_embeddings:
                if "tok_embeddings.weight" not in sd:
                    out["tok_embeddings.weight"] = v
                continue
            if k not in ("tok_embeddings.weight", "norm.weight", "output.weight"):
                raise CheckpointError(f"parameter {k!r} has no InternLM2 equivalent")
            out[k] = v
            continue
        i, mod, kind = int(m.group(1)), m.group(2), m.group(3)
        if mod in ("attention.wq", "attention.wk", "attention.wv"):
            layers.setdefault((i, kind), {})[mod[-2:]] = v
        elif mod in _FFN:
            out[f"layers.{i}.{_FFN[mod]}.{kind}"] = v
        elif mod in _SAME:
            out[f"layers.{i}.{mod}.{kind}"] = v
        else:
            raise CheckpointError(f"parameter {k!r} has no InternLM2 equivalent")
    for (i, kind), p in layers.items():
        out[f"layers.{i}.attention.wqkv.{kind}"] = pack_wqkv(p["wq"], p["wk"], p["wv"], a)
    return out


def _from_internlm2(sd: Mapping[str, torch.Tensor], a: Any, interleaved: bool = False) -> dict[str, torch.Tensor]:
    back = {v: k for k, v in _FFN.items()}
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k.endswith("rotary_emb.inv_freq"):
            continue
        m = _THEIRS.match(k)
        if not m:
            if k not in ("tok_embeddings.weight", "norm.weight", "output.weight"):
                raise CheckpointError(f"InternLM2 tensor {k!r} has no counterpart in internlm-core's model")
            out[k] = v
            continue
        i, mod, kind = int(m.group(1)), m.group(2), m.group(3)
        if mod == "attention.wqkv":
            q, kk, vv = unpack_wqkv(v, a)
            if interleaved:
                q, kk = _deinterleave(q, a.head_dim), _deinterleave(kk, a.head_dim)
            out.update({f"layers.{i}.attention.wq.{kind}": q, f"layers.{i}.attention.wk.{kind}": kk,
                        f"layers.{i}.attention.wv.{kind}": vv})
        elif mod in back:
            out[f"layers.{i}.{back[mod]}.{kind}"] = v
        elif mod in _SAME:
            out[f"layers.{i}.{mod}.{kind}"] = v
        else:
            raise CheckpointError(f"InternLM2 tensor {k!r} has no counterpart in internlm-core's model")
    if a.tie_word_embeddings and "tok_embeddings.weight" in out and "output.weight" not in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


# ---- Hugging Face InternLM2ForCausalLM -------------------------------------------------------------------------

def _hf_name(name: str) -> str:
    return name if name == "output.weight" else "model." + name


def internlm2_to_hf(sd: Mapping[str, torch.Tensor], ctx: AdapterContext) -> dict[str, torch.Tensor]:
    return {_hf_name(k): v for k, v in _to_internlm2(sd, ctx.args).items()}


def internlm2_from_hf(hf: Mapping[str, torch.Tensor], ctx: AdapterContext) -> dict[str, torch.Tensor]:
    plain = {}
    for k, v in hf.items():
        if k != "output.weight" and not k.startswith("model."):
            raise CheckpointError(f"Hugging Face InternLM2 tensor {k!r}: expected model.* or output.weight")
        plain[k if k == "output.weight" else k[len("model."):]] = v
    return _from_internlm2(plain, ctx.args)


def internlm2_config(cfg: Any, torch_dtype: str = "float32",
                     special_ids: Optional[Mapping[str, Optional[int]]] = None) -> dict:
    """The `config.json` of an `InternLM2ForCausalLM` (InternLM2's remote code, model_type "internlm2")."""
    refuse_options(cfg.model, "InternLM2ForCausalLM")
    kind = rope_scaling_kind(cfg.model.rope_scaling)
    if kind not in ("default", "linear", "dynamic"):
        raise CheckpointError(f"model.rope_scaling={cfg.model.rope_scaling}: InternLM2ForCausalLM scales its rotary "
                              "embedding linearly or by dynamic NTK only")
    c = _common_config(cfg, torch_dtype, special_ids)
    del c["rope_parameters"]  # transformers' key; InternLM2's remote code reads rope_scaling = {type, factor}
    scaling = {"type": kind, "factor": cfg.model.rope_scaling["factor"]} if kind != "default" else None
    return {"architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2",
            "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config",
                         "AutoModel": "modeling_internlm2.InternLM2ForCausalLM",
                         "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"},
            **c, "bias": bool(cfg.model.qkv_bias), "rope_scaling": scaling, "attn_implementation": "eager"}


def config_from_internlm2(c: Mapping, where: str = "config.json") -> dict:
    """Our `model` keys of an InternLM2ForCausalLM config.json (`bias` on wqkv and wo: InternLM2Config's default
    true where the key is left out; the published folders say false)."""
    out = _shape_keys(c, where)
    out["qkv_bias"] = bool(c.get("bias", True))
    out.update(rope_from_config(c, where))  # InternLM2's {type: linear | dynamic, factor}
    return out


INTERNLM2_HF = StateDictAdapter(format="hf", to_foreign=internlm2_to_hf, from_foreign=internlm2_from_hf,
                                foreign_config=internlm2_config, config_from_foreign=config_from_internlm2,
                                architectures=("InternLM2ForCausalLM",), hf_model_types=("internlm2",),
                                description="Hugging Face InternLM2ForCausalLM (remote code)")


# ---- InternEvo's training checkpoints (model_tp{t}_pp{p}.pt) ---------------------------------------------------

def _tp_dim(name: str, ctx: AdapterContext) -> Optional[int]:
    if name == "tok_embeddings.weight":
        return 1 if ctx.options.get("embed_split_hidden", True) else 0
    if name == "output.weight":
        return 0
    if name == "norm.weight":
        return None
    m = _THEIRS.match(name)
    mod = m.group(2) if m else ""
    if mod not in _TP_DIM:
        raise CheckpointError(f"InternEvo tensor {name!r} has no counterpart in internlm-core's model")
    dim = _TP_DIM[mod]
    return None if (dim == 1 and m.group(3) == "bias") else dim  # a row-parallel bias is replicated


def _interleaved(ctx: AdapterContext) -> bool:
    o = ctx.options
    return bool(o.get("qk_interleaved", False)) or o.get("adapt_hf", True) is False


def to_internevo(sd: Mapping[str, torch.Tensor], ctx: AdapterContext) -> dict[int, dict[str, torch.Tensor]]:
    out: dict[int, dict[str, torch.Tensor]] = {r: {} for r in range(ctx.tp)}
    for k, v in _to_internlm2(sd, ctx.args).items():
        dim = _tp_dim(k, ctx)
        parts = [v] * ctx.tp if dim is None else list(torch.chunk(v, ctx.tp, dim=dim))
        for r in range(ctx.tp):
            out[r][k] = parts[r].contiguous()
    return out


def from_internevo(shards: Mapping[int, Mapping[str, torch.Tensor]], ctx: AdapterContext) -> dict[str, torch.Tensor]:
    states = [shards[r] for r in range(len(shards))]
    merged = {}
    for k in states[0]:
        if k.endswith("rotary_emb.inv_freq"):
            continue
        dim = _tp_dim(k, ctx)
        merged[k] = states[0][k] if dim is None else torch.cat([s[k] for s in states], dim=dim)
    return _from_internlm2(merged, ctx.args, interleaved=_interleaved(ctx))


def internevo_model_config(cfg: Any, torch_dtype: str = "bfloat16", special_ids: Any = None) -> dict:
    m = cfg.model
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    return {"checkpoint": False, "num_chunks": 1, "num_attention_heads": m.num_attention_heads,
            "num_kv_attention_heads": m.num_kv_attention_heads, "embed_split_hidden": True,
            "vocab_size": m.vocab_size, "embed_grad_scale": m.embed_grad_scale, "parallel_output": True,
            "hidden_size": m.hidden_size, "num_layers": m.num_layers, "no_bias": not m.qkv_bias,
            "mlp_ratio": m.mlp_ratio, "apply_post_layer_norm": m.apply_post_layer_norm,
            "dtype": dtypes.get(torch_dtype, torch.bfloat16), "norm_type": m.norm_type,
            "layer_norm_epsilon": m.layer_norm_epsilon, "use_flash_attn": True, "qk_interleaved": False,
            "rope_base": float(m.rope_base)}


def config_from_internevo(c: Mapping) -> dict:
    keys = {k: c[k] for k in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_attention_heads",
                              "vocab_size", "layer_norm_epsilon", "mlp_ratio") if k in c}
    if "no_bias" in c:
        keys["qkv_bias"] = not bool(c["no_bias"])
    if "rope_base" in c:
        keys["rope_base"] = float(c["rope_base"])
    return keys


INTERNEVO_CKPT = StateDictAdapter(format="internlm", to_foreign=to_internevo, from_foreign=from_internevo,
                                  foreign_config=internevo_model_config, config_from_foreign=config_from_internevo,
                                  description="InternEvo InternLM2 checkpoint folder (model_tp{t}_pp{p}.pt)")
