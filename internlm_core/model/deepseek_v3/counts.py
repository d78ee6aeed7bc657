"""DEEPSEEK_V3's counts (model/counts.py) for the estimator: latent attention's parameters, FLOPs and saved
activations, and the MoE families' FFN terms (internlm_moe/counts.py) for the MoE blocks, the dense SwiGLU for the
first_k_dense_replace blocks.

Per token and block, with H heads (per tensor rank: "tp"), d = nope + rope q/k head dim, v the value head dim,
q_r / kv_r the low ranks, rope the rotary width, a compute bytes, n tensors an RMSNorm keeps of r bytes:

    parameters         wq_a [q_r, h], wq_b [H d, q_r] (or wq [H d, h]), wkv_a [kv_r + rope, h],
                       wkv_b [H (nope + v), kv_r], wo [h, H v], the norms (h, h, q_r, kv_r)
    latents            a * (q_r + kv_r + rope) + n * a * (q_r + kv_r) + 16   wq_a, wkv_a outputs, their norms
    linear inputs      k * a * h + a * (q_r + kv_r)    x into wq_a / wkv_a (k = 2 casts under autocast, else 1 kept
                                                       once) and the FFN's, the normed latents into wq_b / wkv_b
    q, k, v, output    a * (2 H d + 2 H v)             per head; flash / torch_varlen pad v to d (+ 2 a H (d - v))
    rotary             a * (H + 1) * rope              q's and the shared key's rope channels before rotation
    attention          4 H (log-sum-exp) or the blocked CPU kernel's probabilities, as the dense block's

FLOPs per token: 2 per weight a token multiplies (k of E experts) and 2 * H * s * (d + v) for the scores (d) and
the values (v) over s keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..counts import ActivationContext, Linear, ModelCounts, Parameters, Term, keys_per_query
from ..internlm import counts as dense
from ..internlm_moe import counts as moe_counts
from .model import PADDED_V

TP, SP = ("tp",), ("sp",)


def layer_args(a: Any) -> tuple[Any, ...]:
    """Each block's args: `a` for an MoE block, `a` with moe=None (the dense SwiGLU) for a dense one."""
    plain = dataclasses.replace(a, moe=None)
    return tuple(a if a.layer_mix.is_moe(i) else plain for i in range(a.num_layers))


def attention_linears(a: Any) -> list[Linear]:
    """Latent attention's matrices: the heads' column-split (tp), the low-rank projections replicated."""
    m, h, H = a.mla, a.hidden_size, a.num_heads
    if m.q_lora_rank is None:
        q = [Linear("attention.wq", H * m.qk_head_dim, h, TP)]
    else:
        q = [Linear("attention.wq_a", m.q_lora_rank, h), Linear("attention.wq_b", H * m.qk_head_dim, m.q_lora_rank, TP)]
    return q + [Linear("attention.wkv_a", m.kv_lora_rank + m.qk_rope_head_dim, h),
                Linear("attention.wkv_b", H * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, TP),
                Linear("attention.wo", h, H * m.v_head_dim, TP, split="in")]


def block(a: Any) -> Parameters:
    """Latent attention, the two block norms and the low-rank norms, and the FFN: the dense SwiGLU (moe None) or
    the router, the experts (split over "ep") and the shared experts (tp, as a dense FFN)."""
    m, h = a.mla, a.hidden_size
    ffn = [w for w in moe_counts.block(a).linears if w.name.startswith("feed_forward.")  # InternEvo's shared
           and not w.name.startswith(("feed_forward.shared_experts", "feed_forward.coefficient"))]  # mix: not ours
    if a.moe is not None and a.moe.num_shared_experts:
        s = a.moe.num_shared_experts * a.moe.ffn_width
        ffn += [Linear("feed_forward.shared_experts.w1", s, h, TP), Linear("feed_forward.shared_experts.w3", s, h, TP),
                Linear("feed_forward.shared_experts.w2", h, s, TP, split="in")]
    norms = 2 * h + m.kv_lora_rank + (m.q_lora_rank or 0)
    return Parameters(tuple(attention_linears(a) + ffn), (Term("norms", norms, TP),))


def parameters_of(a: Any) -> int:
    """Every block's parameters (dense and MoE blocks), the embedding and the head."""
    return sum(block(b).count for b in layer_args(a)) + dense.embedding(a).count + dense.head(a).count


def _active_block(a: Any) -> int:
    weights = sum(w.elements for w in block(a).linears if not w.name.startswith("feed_forward.experts."))
    return weights + (3 * a.moe.top_k * a.moe.ffn_width * a.hidden_size if a.moe is not None else 0)


def active_parameters(a: Any) -> int:
    """Parameters one token's forward multiplies (k of E experts per MoE block), the embedding row and the head
    included: DeepSeek's "activated parameters"."""
    return sum(_active_block(b) for b in layer_args(a)) + dense.embedding(a).count + dense.head(a).count


def attention_flops_per_token(a: Any, seq_len: int) -> float:
    """Scores over d = nope + rope channels and values over v, s keys each, multiply-add."""
    return 2 * a.num_heads * seq_len * (a.mla.qk_head_dim + a.mla.v_head_dim)


def block_flops_per_token(a: Any, seq_len: int) -> float:
    return 2 * _active_block(a) + attention_flops_per_token(a, seq_len)


def block_activations(a: Any, c: ActivationContext) -> list[Term]:
    """The terms of the module docstring, and the FFN's (dense SwiGLU, or the MoE layer's with its shared
    experts)."""
    m, h, H, comp = a.mla, a.hidden_size, a.num_heads, c.compute_bytes
    v_kept = m.qk_head_dim if c.attention in PADDED_V else m.v_head_dim
    ranks = m.kv_lora_rank + (m.q_lora_rank or 0)
    probs = Term("attention probabilities", (4 + (2 if comp == 2 else 0)) * H * keys_per_query(c.seq_len), TP) \
        if c.attention == "cpu_blocked" else Term("log-sum-exp", 4 * H, TP)
    terms = [Term("norms", 2 * (c.norm_tensors * (c.norm_bytes or c.residual_bytes) * h + 8), SP),
             Term("linear inputs", ((4 if c.autocast else 2) * h + ranks) * comp, SP),
             Term("latents", comp * (ranks + m.qk_rope_head_dim) + c.norm_tensors * (c.norm_bytes or comp) * ranks
                  + 16),
             Term("q, k, v, attention output", comp * H * (2 * m.qk_head_dim + 2 * v_kept), TP),
             Term("rotary inputs", comp * (H + 1) * m.qk_rope_head_dim, TP), probs]
    if c.attention == "sdpa" and c.packed_documents:
        terms.append(Term("document mask", comp * c.seq_len))
    ffn = moe_counts.block_activations(a, c) if a.moe is not None else [Term("SwiGLU", 4 * comp * a.ffn_width, TP)]
    terms += [t for t in ffn if t.name in ("router", "routed copies", "experts' SwiGLU", "SwiGLU")]
    if a.moe is not None and a.moe.num_shared_experts:
        terms.append(Term("shared experts' SwiGLU", 4 * comp * a.moe.num_shared_experts * a.moe.ffn_width, TP))
    return terms


def shared_activations(a: Any, c: ActivationContext) -> list[Term]:
    """Token ids, the rotary rows over the rope channels, the masks (as the dense family's)."""
    return dense.shared_activations(a, c)


def block_communication(a: Any, c: ActivationContext) -> list[Term]:
    return moe_counts.block_communication(a, c) if a.moe is not None else []


COUNTS = ModelCounts(block=block, embedding=dense.embedding, head=dense.head,
                     block_flops_per_token=block_flops_per_token, block_activations=block_activations,
                     checkpointed_block_activations=dense.checkpointed_block_activations,
                     shared_activations=shared_activations, head_activations=dense.head_activations,
                     logits=dense.logits, block_communication=block_communication, layer_args=layer_args,
                     active_parameters=active_parameters)


def num_parameters(a: Any) -> int:
    """The model's parameter count from its shape (equal to the built module's: tests/unit/test_deepseek_v3.py);
    model.mtp's depths included (each its block, eh_proj and three norms)."""
    h = a.hidden_size
    return parameters_of(a) + sum(block(b).count + 2 * h * h + 3 * h for b in _mtp_args(a))


def _mtp_args(a: Any) -> list[Any]:
    """model.mtp's blocks' args: block num_layers + k of the stack (MoE from first_k_dense_replace on)."""
    plain = dataclasses.replace(a, moe=None)
    return [a if a.layer_mix.is_moe(a.num_layers + k) else plain for k in range(a.mtp_depth)]


def flops_per_token(a: Any, seq_len: int) -> int:
    """Model FLOPs per trained token: 6 per active non-embedding parameter (the head included) and the attention
    scores and values, 3 x the forward's (the dense convention, full s x s square)."""
    active = active_parameters(a) - dense.embedding(a).count
    h, depths = a.hidden_size, _mtp_args(a)  # model.mtp: each depth a block, eh_proj and the head once more
    active += sum(_active_block(b) + 2 * h * h + dense.head(a).count for b in depths)
    return int(6 * active + 3 * (a.num_layers + len(depths)) * attention_flops_per_token(a, seq_len))
