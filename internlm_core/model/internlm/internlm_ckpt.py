"""InternLM v1's own checkpoint names (InternLM/InternLM at aaaf4d7, `model_tp{t}_pp{p}.pt`), both ways.

The foreign side is {tensor rank: state dict} with the pipeline stages merged (global layer numbers, "model."
prefix removed), which is how InternLM's tools/transformers/convert2hf.py sees a folder. Its merge rules:

    embedding.weight                       hidden split (embed_split_hidden=True: cat dim 1), else vocabulary (dim 0)
    blocks.{i}.mixer.Wqkv.{weight,bias}    each shard is (3, heads/tp, head_dim[, hidden]): q, k, v by heads
    blocks.{i}.mixer.out_proj.weight       row parallel: cat dim 1; its bias is replicated (rank 0's)
    blocks.{i}.mlp.w1 (gate), w2 (up)      column parallel: cat dim 0;   w3 (down): cat dim 1 (InternEvo's later
                                           releases swap the names of up and down: told apart by shape on read)
    blocks.{i}.norm1 / norm2, norm.weight  replicated;   head.weight: cat dim 0
    blocks.{i}.mixer.rotary_emb.inv_freq   a buffer: skipped on read, written for InternLM's module

Ours: tok_embeddings, layers.{i}.attention.w{q,k,v,o}, feed_forward.w{1,2,3}, attention_norm, ffn_norm, norm,
output. InternLM's module always has q/k/v/o biases: a model without them is written with zero biases.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from ...errors import CheckpointError
from ..spec import AdapterContext, StateDictAdapter

_EMBED_KEYS = ("embedding.weight", "embedding.word_embeddings.weight", "tok_embeddings.weight")
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")
_OURS = re.compile(r"^layers\.(\d+)\.(.+)$")
_SIMPLE = {  # ours (in a layer) -> (InternLM's, dim along which tensor-parallel shards are concatenated or None)
    "attention.wo.weight": ("mixer.out_proj.weight", 1),
    "attention.wo.bias": ("mixer.out_proj.bias", None),
    "feed_forward.w1.weight": ("mlp.w1.weight", 0),
    "feed_forward.w2.weight": ("mlp.w2.weight", 0),
    "feed_forward.w3.weight": ("mlp.w3.weight", 1),
    "attention_norm.weight": ("norm1.weight", None),
    "ffn_norm.weight": ("norm2.weight", None),
}


# InternEvo's later FeedForward (internlm/model/modules/mlp.py) names up w3 and down w2, as Llama does
_LATER_FFN = {"feed_forward.w2.weight": "mlp.w3.weight", "feed_forward.w3.weight": "mlp.w2.weight"}


def later_ffn_names(w2: torch.Tensor | None, w3: torch.Tensor | None, hidden: int) -> bool:
    """True when a FeedForward's w2 / w3 (one tensor rank's shards) are named as InternEvo's later releases name
    them (w3 up [F, H], w2 down [H, F]) rather than as InternLM v1 and InternEvo's early MoE (w2 up, w3 down). The
    shapes decide; when the FFN width per tensor rank equals the hidden size they cannot, and InternLM's names are
    assumed."""
    if w2 is None or w3 is None or w2.dim() != 2:
        return False
    return w2.shape[0] == hidden and w3.shape[1] == hidden and w2.shape[1] != hidden


def _split(t: torch.Tensor, tp: int, dim: int | None) -> list[torch.Tensor]:
    if dim is None:
        return [t] * tp
    if t.shape[dim] % tp:
        raise CheckpointError(f"a tensor of shape {tuple(t.shape)} cannot be split {tp} ways along dim {dim}")
    return list(torch.chunk(t, tp, dim=dim))


def _cat(shards: list[torch.Tensor], dim: int | None) -> torch.Tensor:
    return shards[0] if dim is None else torch.cat(shards, dim=dim)


def _embed_dim(ctx: AdapterContext) -> int:
    return 1 if ctx.options.get("embed_split_hidden", True) else 0


def _pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, tp: int) -> list[torch.Tensor]:
    """Our q, k, v → each tensor rank's Wqkv: (3, heads/tp, head_dim[, hidden]) flattened."""
    parts = [x.reshape(tp, heads // tp, -1, *x.shape[1:]) for x in (q, k, v)]  # [tp, h/tp, d(, H)]
    packed = torch.stack(parts, dim=1)  # [tp, 3, h/tp, d(, H)]
    return [packed[r].reshape(-1, *q.shape[1:]) for r in range(tp)]


def _unpack_qkv(shards: list[torch.Tensor], heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tp = len(shards)
    views = [s.reshape(3, heads // tp, -1, *s.shape[1:]) for s in shards]
    q, k, v = (torch.cat([w[j] for w in views], dim=0) for j in range(3))
    return tuple(x.reshape(-1, *x.shape[2:]) for x in (q, k, v))  # type: ignore[return-value]


def to_internlm(sd: Mapping[str, torch.Tensor], ctx: AdapterContext) -> dict[int, dict[str, torch.Tensor]]:
    """Our state dict (whole layers) → {tensor rank: InternLM's names}."""
    tp, a = ctx.tp, ctx.args
    out: dict[int, dict[str, torch.Tensor]] = {r: {} for r in range(tp)}

    def put(name: str, shards: list[torch.Tensor]) -> None:
        for r in range(tp):
            out[r][name] = shards[r].contiguous()

    layers: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in sd.items():
        m = _OURS.match(k)
        if m:
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = v
        elif k == "tok_embeddings.weight":
            put("embedding.weight", _split(v, tp, _embed_dim(ctx)))
        elif k == "norm.weight":
            put("norm.weight", _split(v, tp, None))
        elif k == "output.weight":
            put("head.weight", _split(v, tp, 0))
        else:
            raise CheckpointError(f"parameter {k!r} has no InternLM checkpoint name")
    if a.num_kv_heads != a.num_heads:
        raise CheckpointError("InternLM v1 checkpoints have no grouped-query attention (num_kv_attention_heads "
                              "must equal num_attention_heads)")
    for i, p in sorted(layers.items()):
        pre = f"blocks.{i}."
        for kind in ("weight", "bias"):
            q, k, v = (p.get(f"attention.w{x}.{kind}") for x in "qkv")
            if q is None and kind == "bias":  # InternLM's module has the biases: zeros keep the math
                hid = p["attention.wq.weight"]
                q = k = v = torch.zeros(hid.shape[0], dtype=hid.dtype, device=hid.device)
            put(pre + f"mixer.Wqkv.{kind}", _pack_qkv(q, k, v, a.num_heads, tp))
        if "attention.wo.bias" not in p:
            wo = p["attention.wo.weight"]
            p = {**p, "attention.wo.bias": torch.zeros(wo.shape[0], dtype=wo.dtype, device=wo.device)}
        for ours, (theirs, dim) in _SIMPLE.items():
            if ours.startswith("feed_forward.") and ours not in p:
                continue  # a mixture-of-experts block: its family's adapter names the feed-forward
            put(pre + theirs, _split(p[ours], tp, dim))
        inv_freq = 1.0 / (a.rope_base ** (torch.arange(0, a.head_dim, 2, dtype=torch.float32) / a.head_dim))
        put(pre + "mixer.rotary_emb.inv_freq", [inv_freq] * tp)
    return out


def from_internlm(shards: Mapping[int, Mapping[str, torch.Tensor]], ctx: AdapterContext) -> dict[str, torch.Tensor]:
    """{tensor rank: InternLM's names} → our names, merged as InternLM's convert2hf.py merges them."""
    tp = len(shards)
    states = [shards[r] for r in range(tp)]
    a = ctx.args
    out: dict[str, torch.Tensor] = {}
    first = states[0]
    layers = sorted({int(m.group(1)) for k in first if (m := _BLOCK.match(k))})
    for i in layers:
        pre = f"blocks.{i}."
        for kind in ("weight", "bias"):
            key = pre + f"mixer.Wqkv.{kind}"
            if key not in first:
                continue
            q, k, v = _unpack_qkv([s[key] for s in states], a.num_heads)
            if kind == "bias" and not a.qkv_bias:
                if any(t.abs().max() > 0 for t in (q, k, v)):
                    raise CheckpointError(f"{key}: the checkpoint has non-zero q/k/v biases, the model has none "
                                          f"(model.qkv_bias=False)")
                continue
            out.update({f"layers.{i}.attention.w{x}.{kind}": t for x, t in zip("qkv", (q, k, v))})
        later = later_ffn_names(first.get(pre + "mlp.w2.weight"), first.get(pre + "mlp.w3.weight"), a.hidden_size)
        for ours, (theirs, dim) in _SIMPLE.items():
            if later and ours in _LATER_FFN:
                theirs = _LATER_FFN[ours]
            key = pre + theirs
            if key not in first:
                continue
            if ours == "attention.wo.bias" and not a.qkv_bias:
                if first[key].abs().max() > 0:
                    raise CheckpointError(f"{key}: the checkpoint has a non-zero output bias, the model has none "
                                          f"(model.qkv_bias=False)")
                continue
            out[f"layers.{i}.{ours}"] = _cat([s[key] for s in states], dim)
    for key in _EMBED_KEYS:
        if key in first:
            parts = [s[key] for s in states]
            dim = _embed_dim(ctx) if tp > 1 else 0
            if tp > 1 and parts[0].shape[1] * tp == a.hidden_size and parts[0].shape[0] == a.vocab_size:
                dim = 1  # the shards say how they were split
            elif tp > 1 and parts[0].shape[0] * tp == a.vocab_size and parts[0].shape[1] == a.hidden_size:
                dim = 0
            out["tok_embeddings.weight"] = _cat(parts, dim)
            break
    if "norm.weight" in first:
        out["norm.weight"] = first["norm.weight"]
    if "head.weight" in first:
        out["output.weight"] = _cat([s["head.weight"] for s in states], 0)
    elif a.tie_word_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def internlm_model_config(cfg: Any, torch_dtype: str = "bfloat16", special_ids: Any = None) -> dict:
    """InternLM's model_config.pt: its `model` section as its launch resolves it (dtype a torch.dtype)."""
    m = cfg.model
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    return {"checkpoint": False, "num_attention_heads": m.num_attention_heads, "embed_split_hidden": True,
            "vocab_size": m.vocab_size, "embed_grad_scale": m.embed_grad_scale, "parallel_output": True,
            "hidden_size": m.hidden_size, "num_layers": m.num_layers, "mlp_ratio": m.mlp_ratio,
            "apply_post_layer_norm": m.apply_post_layer_norm, "dtype": dtypes.get(torch_dtype, torch.bfloat16),
            "norm_type": m.norm_type, "layer_norm_epsilon": m.layer_norm_epsilon, "use_flash_attn": True,
            "num_chunks": 1, "rope_base": float(m.rope_base)}


def config_from_internlm_ckpt(c: Mapping) -> dict:
    """Our `model` keys from InternLM's model_config.pt (the FFN width comes from the tensors)."""
    keys = {k: c[k] for k in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "layer_norm_epsilon",
                              "mlp_ratio", "apply_post_layer_norm") if k in c}
    if "rope_base" in c:
        keys["rope_base"] = float(c["rope_base"])
    if c.get("num_kv_attention_heads") not in (None, c.get("num_attention_heads")):
        raise CheckpointError("model_config.pt: num_kv_attention_heads differs from num_attention_heads; an "
                              "InternLM v1 checkpoint has none (is this an InternLM2 checkpoint? use model_type "
                              "INTERNLM2)")
    return keys


INTERNLM_CKPT = StateDictAdapter(format="internlm", to_foreign=to_internlm, from_foreign=from_internlm,
                                 foreign_config=internlm_model_config, config_from_foreign=config_from_internlm_ckpt,
                                 description="InternLM v1 checkpoint folder (model_tp{t}_pp{p}.pt)")
