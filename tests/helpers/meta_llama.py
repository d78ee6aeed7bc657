"""Meta's original Llama folders as Meta's code writes them (llama/model.py's names; fairscale's model-parallel
shards: ColumnParallelLinear splits wq/wk/wv/w1/w3/output by rows, RowParallelLinear wo/w2 by columns, Llama 2's
ParallelEmbedding the hidden size and Llama 3's VocabParallelEmbedding the vocabulary; norms replicated), written
from the published layout without internlm-core's adapter (tests/unit/test_meta_llama.py, tests/dist)."""

from __future__ import annotations

import json

import torch

LLAMA2 = dict(dim=64, n_layers=2, n_heads=4, multiple_of=32, norm_eps=1e-5, vocab_size=-1)  # vocab from tensors
LLAMA3 = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32, ffn_dim_multiplier=1.3,
              norm_eps=1e-5, rope_theta=500000.0)
VOCAB = 96
COLUMN = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")  # split dim 0
ROW = ("attention.wo", "feed_forward.w2")  # split dim 1


def meta_shapes(p: dict) -> dict:
    """Meta's names and shapes (llama/model.py's Transformer) of params `p`."""
    d, h = p["dim"], p["n_heads"]
    kv, hd = p.get("n_kv_heads") or h, p["dim"] // p["n_heads"]
    f = int(2 * 4 * d / 3)
    f = int(p["ffn_dim_multiplier"] * f) if p.get("ffn_dim_multiplier") else f
    f = p["multiple_of"] * ((f + p["multiple_of"] - 1) // p["multiple_of"])
    out = {"tok_embeddings.weight": (VOCAB, d), "norm.weight": (d,), "output.weight": (VOCAB, d),
           "rope.freqs": (hd // 2,)}
    for i in range(p["n_layers"]):
        out.update({f"layers.{i}.attention.wq.weight": (h * hd, d), f"layers.{i}.attention.wk.weight": (kv * hd, d),
                    f"layers.{i}.attention.wv.weight": (kv * hd, d), f"layers.{i}.attention.wo.weight": (d, h * hd),
                    f"layers.{i}.feed_forward.w1.weight": (f, d), f"layers.{i}.feed_forward.w2.weight": (d, f),
                    f"layers.{i}.feed_forward.w3.weight": (f, d), f"layers.{i}.attention_norm.weight": (d,),
                    f"layers.{i}.ffn_norm.weight": (d,)})
    return out


def meta_weights(p: dict, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: (1.0 + 0.1 * torch.randn(s, generator=g)) if len(s) == 1 else 0.1 * torch.randn(s, generator=g)
            for k, s in meta_shapes(p).items()}


def write_meta_folder(folder, p: dict, full: dict, mp: int, embed_dim: int) -> None:
    """consolidated.{r:02d}.pth as `mp` model-parallel ranks of Meta's code hold them, and params.json."""
    folder.mkdir(parents=True, exist_ok=True)
    for r in range(mp):
        shard = {}
        for k, t in full.items():
            mod = k.rsplit(".", 1)[0].split(".", 2)[-1] if k.startswith("layers.") else k.rsplit(".", 1)[0]
            dim = (0 if mod in COLUMN or k == "output.weight" else 1 if mod in ROW else
                   embed_dim if k == "tok_embeddings.weight" else None)
            shard[k] = t.clone() if dim is None else torch.chunk(t, mp, dim=dim)[r].clone()
        torch.save(shard, folder / f"consolidated.{r:02d}.pth")
    (folder / "params.json").write_text(json.dumps(p))
