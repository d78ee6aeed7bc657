"""Meta's original Llama checkpoints (github.com/meta-llama/llama, llama3): `params.json` and
`consolidated.NN.pth`, one state dict per model-parallel rank of fairscale's layers. InternEvo reads them as
ckpt_type "llama" (its configs write "LLAMA").

    ours                                   Meta's                               model-parallel shards
    tok_embeddings.weight                  tok_embeddings.weight                ParallelEmbedding (Llama 1/2): cat dim 1;
                                                                                VocabParallelEmbedding (Llama 3): dim 0
    layers.{i}.attention.w{q,k,v}.weight   layers.{i}.attention.w{q,k,v}.weight column parallel: cat dim 0
    layers.{i}.attention.wo.weight         layers.{i}.attention.wo.weight       row parallel: cat dim 1
    layers.{i}.feed_forward.w1 (gate)      layers.{i}.feed_forward.w1 (gate)    column parallel: cat dim 0
    layers.{i}.feed_forward.w2 (up)        layers.{i}.feed_forward.w3 (up)      column parallel: cat dim 0
    layers.{i}.feed_forward.w3 (down)      layers.{i}.feed_forward.w2 (down)    row parallel: cat dim 1
    layers.{i}.attention_norm / ffn_norm   the same                             replicated
    norm.weight / output.weight            the same                             replicated / column parallel: dim 0
    (none)                                 rope.freqs                           a buffer: skipped

Meta's rotary embedding turns channel pairs (2j, 2j + 1) of each head as complex numbers; ours (as Hugging
Face's) turns channel j with j + head_dim/2. The rows of wq and wk are permuted per head on the way in (evens,
then odds: the permutation of transformers' convert_llama_weights_to_hf) and back on the way out.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from ...errors import CheckpointError
from ..spec import AdapterContext, StateDictAdapter

# ours (in a layer) -> (Meta's, dim along which the model-parallel shards are concatenated; None: replicated)
_LAYER = {
    "attention.wq.weight": ("attention.wq.weight", 0),
    "attention.wk.weight": ("attention.wk.weight", 0),
    "attention.wv.weight": ("attention.wv.weight", 0),
    "attention.wo.weight": ("attention.wo.weight", 1),
    "feed_forward.w1.weight": ("feed_forward.w1.weight", 0),
    "feed_forward.w2.weight": ("feed_forward.w3.weight", 0),
    "feed_forward.w3.weight": ("feed_forward.w2.weight", 1),
    "attention_norm.weight": ("attention_norm.weight", None),
    "ffn_norm.weight": ("ffn_norm.weight", None),
}
_THEIRS = {theirs: (ours, dim) for ours, (theirs, dim) in _LAYER.items()}
_TOP = {"norm.weight": None, "output.weight": 0}
_ROTATED = ("attention.wq.weight", "attention.wk.weight")
_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")
EMBED = "tok_embeddings.weight"


def to_halves(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of each head from Meta's pairs (0, 1), (2, 3), ... to rotate-half order (0, 2, 4, ..., 1, 3, 5, ...)."""
    return w.reshape(-1, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def to_pairs(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of `to_halves`."""
    return w.reshape(-1, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _embed_dim(shards: list[torch.Tensor], a: Any) -> int:
    """The dim the embedding's shards split, as their shapes say (Llama 1/2 split the hidden size, Llama 3 the
    vocabulary)."""
    rows, cols = shards[0].shape
    return 0 if rows * len(shards) == a.vocab_size and cols == a.hidden_size else 1


def from_meta(shards: Mapping[int, Mapping[str, torch.Tensor]], ctx: AdapterContext) -> dict[str, torch.Tensor]:
    """{model-parallel rank: Meta's names} → our names (shards merged, q/k rows in rotate-half order)."""
    states = [shards[r] for r in range(len(shards))]
    a = ctx.args
    out: dict[str, torch.Tensor] = {}
    for key in states[0]:
        if key.endswith("rope.freqs"):
            continue
        m = _NAME.match(key)
        if m and m.group(2) in _THEIRS:
            ours, dim = _THEIRS[m.group(2)]
            ours = f"layers.{m.group(1)}.{ours}"
        elif key in _TOP:
            ours, dim = key, _TOP[key]
        elif key == EMBED:
            ours, dim = key, None
        else:
            raise CheckpointError(f"Meta Llama tensor {key!r} has no counterpart in internlm-core's model (expected "
                                  f"tok_embeddings, layers.N.attention.w{{q,k,v,o}}, layers.N.feed_forward.w{{1,2,3}}, "
                                  f"layers.N.{{attention,ffn}}_norm, norm, output, rope.freqs)")
        missing = [r for r, s in enumerate(states) if key not in s]
        if missing:
            raise CheckpointError(f"Meta Llama tensor {key!r} is in shard 0 but not in shard {missing[0]}")
        parts = [s[key] for s in states]
        if key == EMBED:
            dim = _embed_dim(parts, a) if len(parts) > 1 else None
        t = parts[0] if dim is None else torch.cat(parts, dim=dim)
        if m and m.group(2) in _ROTATED:
            t = to_halves(t, a.head_dim)
        out[ours] = t
    return out


def to_meta(sd: Mapping[str, torch.Tensor], ctx: AdapterContext) -> dict[int, dict[str, torch.Tensor]]:
    """Our state dict (whole layers) → {model-parallel rank: Meta's names}, split `ctx.tp` ways (the embedding
    along options["embed_dim"], default 1 as Llama 2)."""
    tp, a = ctx.tp, ctx.args
    out: dict[int, dict[str, torch.Tensor]] = {r: {} for r in range(tp)}
    for key, t in sd.items():
        m = _NAME.match(key)
        if m and m.group(2) in _LAYER:
            theirs, dim = _LAYER[m.group(2)]
            theirs = f"layers.{m.group(1)}.{theirs}"
            if m.group(2) in _ROTATED:
                t = to_pairs(t, a.head_dim)
        elif key in _TOP and not (key == "output.weight" and a.tie_word_embeddings):
            theirs, dim = key, _TOP[key]
        elif key == EMBED:
            theirs, dim = key, int(ctx.options.get("embed_dim", 1))
        else:
            raise CheckpointError(f"parameter {key!r} has no Meta Llama equivalent (Meta's Llama has no biases and "
                                  f"no tied output)")
        parts = [t] * tp if dim is None else list(torch.chunk(t, tp, dim=dim))
        if len(parts) != tp or any(p.shape != parts[0].shape for p in parts):
            raise CheckpointError(f"{key}: shape {tuple(t.shape)} does not split {tp} ways along dim {dim}")
        for r in range(tp):
            out[r][theirs] = parts[r].contiguous()
    return out


def meta_ffn_width(dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float]) -> int:
    """Meta's FeedForward width: 2/3 of 4 * dim, times ffn_dim_multiplier, rounded up to multiple_of."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def config_from_meta(params: Mapping[str, Any], where: str = "params.json") -> dict:
    """Our `model` keys of a Meta params.json (vocab_size -1, as Llama 2 writes it, leaves the vocabulary to the
    tensors; scaled rotary frequencies, use_scaled_rope of Llama 3.1, are refused)."""
    try:
        dim, layers, heads = int(params["dim"]), int(params["n_layers"]), int(params["n_heads"])
    except KeyError as e:
        raise CheckpointError(f"{where}: missing key {e.args[0]!r} (expected dim, n_layers, n_heads)") from None
    if params.get("use_scaled_rope"):
        raise CheckpointError(f"{where}: use_scaled_rope=true (Llama 3.1 frequency scaling) is not implemented by "
                              f"internlm-core's rotary embedding")
    mult = params.get("ffn_dim_multiplier")
    out = {"num_layers": layers, "hidden_size": dim, "num_attention_heads": heads,
           "num_kv_attention_heads": int(params.get("n_kv_heads") or heads),
           "intermediate_size": meta_ffn_width(dim, int(params.get("multiple_of", 256)),
                                               None if mult is None else float(mult)),
           "layer_norm_epsilon": float(params.get("norm_eps", 1e-5)),
           "rope_base": float(params.get("rope_theta", 10000.0)), "qkv_bias": False, "tie_word_embeddings": False}
    if int(params.get("vocab_size", -1)) > 0:
        out["vocab_size"] = int(params["vocab_size"])
    return out


PARAMS = "params.json"
_CONSOLIDATED = re.compile(r"^consolidated\.(\d+)\.pth$")


def meta_llama_files(folder: str | os.PathLike) -> list[Path]:
    """The model-parallel shards of a Meta folder, in rank order (CheckpointError when there are none). As
    InternEvo's loader, a folder without `consolidated.*.pth` files may hold other `*.pth` files, taken in name
    order as model-parallel ranks 0, 1, ..."""
    d = Path(folder)
    if not d.is_dir():
        raise CheckpointError(f"{d}: Meta Llama checkpoint folder not found")
    found = sorted(((int(m.group(1)), p) for p in d.iterdir() if (m := _CONSOLIDATED.match(p.name))))
    if found:
        ranks = [r for r, _ in found]
        if ranks != list(range(len(ranks))):
            raise CheckpointError(f"{d}: consolidated.*.pth numbered {ranks}; expected 00 to {len(ranks) - 1:02d}")
        return [p for _, p in found]
    other = sorted(p for p in d.iterdir() if p.suffix in (".pth", ".pt") and p.is_file())
    if not other:
        raise CheckpointError(f"{d}: no consolidated.NN.pth (or other .pth) files of a Meta Llama checkpoint")
    return other


META_LLAMA = StateDictAdapter(format="llama", to_foreign=to_meta, from_foreign=from_meta,
                              config_from_foreign=config_from_meta, config_file=PARAMS, shard_files=meta_llama_files,
                              description="Meta's original Llama folder (params.json, consolidated.NN.pth)")
