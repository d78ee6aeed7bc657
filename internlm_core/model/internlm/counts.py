"""The InternLM transformer's counts (model/counts.py) for the estimator: its parameters, FLOPs and the bytes its
backward keeps, term by term (checked against `saved_tensors_hooks` in tests/unit/test_estimate.py).

Per token and block, h hidden, kv key/value width, f FFN width, H heads, s seq_len, a compute bytes, r residual
bytes (fp32 under autocast without FSDP; see ActivationContext), n tensors an RMSNorm keeps, each of r bytes
per element (4 on CPU: torch's composite norm keeps fp32 copies; see ActivationContext.norm_bytes):

    2 RMSNorms         2 * (n * r * h + 8)       the normalized input(s) and the fp32 rstd
    linear inputs      k * a * h                 k = 5 under autocast (q, k, v, w1, w2 each cast their input),
                                                 2 when the compute dtype is the parameter dtype (or FSDP's)
    attention          a * (2h + 2kv) + 4H       q, k, v, output, log-sum-exp (flash-attn, SDPA)
    document mask      a * s                     SDPA with a packed-document mask only (not flash-attn)
    cpu_blocked        a * (2h + 2kv) + p * H * w  q, k, v, output and the probabilities, w keys per query on
                                                 average (about s/2 + s/8 for blocks of s/4), p = 4 (fp32
                                                 softmax) + 2 with 16-bit compute (their 16-bit copy)
    SwiGLU FFN         4 * a * f                 w1 x, silu(w1 x), w2 x, their product

A recomputed block keeps its input (r * h). Once per micro-batch: the token ids (8), the rotary cos/sin rows
(8 * head_dim), SDPA's bool document mask (s) or the blocked attention's bool block masks (w, packed documents
only). Head: the final norm (n * r * h + 8) and the output layer's input (a * h). Tensor parallel splits heads,
FFN columns and the vocabulary ("tp"); sequence parallel the norm side ("sp").
"""

from __future__ import annotations

from ..args import ModelArgs
from ..counts import ActivationContext, Linear, ModelCounts, Parameters, Term, keys_per_query

TP, SP = ("tp",), ("sp",)


def block(a: ModelArgs) -> Parameters:
    """q, k, v, o and the SwiGLU's w1, w2 (column-parallel: out) and w3 (row-parallel: in), two norm scales,
    InternLM v1's biases. The norm scales and o's bias are the same on every tensor-parallel rank but counted as
    split, as all of a block's parameters (a few h per block)."""
    h, kv, f = a.hidden_size, a.num_kv_heads * a.head_dim, a.ffn_width
    q = a.num_heads * a.head_dim  # h unless model.head_dim says otherwise
    linears = (Linear("attention.wq", q, h, TP), Linear("attention.wk", kv, h, TP),
               Linear("attention.wv", kv, h, TP), Linear("attention.wo", h, q, TP, split="in"),
               Linear("feed_forward.w1", f, h, TP), Linear("feed_forward.w2", f, h, TP),
               Linear("feed_forward.w3", h, f, TP, split="in"))
    biases = (q + 2 * kv if a.qkv_bias else 0) + (h if a.wo_bias else 0)
    others = (Term("norms", 2 * h, TP),) + ((Term("attention biases", biases, TP),) if biases else ()) \
        + ((Term("q/k norms", 2 * a.head_dim),) if a.qk_norm else ())  # replicated on every tensor rank
    return Parameters(linears, others)


def embedding(a: ModelArgs) -> Parameters:
    return Parameters(others=(Term("tok_embeddings", a.vocab_size * a.hidden_size, TP),))


def head(a: ModelArgs) -> Parameters:
    """The final norm and the output layer (the embedding's matrix when tied)."""
    out = Linear("output", a.vocab_size, a.hidden_size, TP, own=not a.tie_word_embeddings)
    return Parameters((out,), (Term("norm", a.hidden_size, TP),))


def block_flops_per_token(a: ModelArgs, seq_len: int) -> float:
    """2 per weight (multiply-add) and the attention scores and values (attention_flops_per_token)."""
    return 2 * sum(w.elements for w in block(a).linears) + attention_flops_per_token(a, seq_len)


def attention_flops_per_token(a: ModelArgs, seq_len: int) -> float:
    """4 * heads * head_dim * s: the scores and values of a query over s keys (at most the sliding window's)."""
    keys = min(seq_len, a.sliding_window) if a.sliding_window else seq_len
    return 4 * a.num_heads * a.head_dim * keys


def block_activations(a: ModelArgs, c: ActivationContext) -> list[Term]:
    h, kv, f, H = a.hidden_size, a.num_kv_heads * a.head_dim, a.ffn_width, a.num_heads
    q = H * a.head_dim
    comp = c.compute_bytes
    if c.attention == "cpu_blocked":
        probs = Term("attention probabilities", (4 + (2 if comp == 2 else 0)) * H * keys_per_query(c.seq_len), TP)
    else:
        probs = Term("log-sum-exp", 4 * H, TP)
    terms = [Term("norms", 2 * (c.norm_tensors * (c.norm_bytes or c.residual_bytes) * h + 8), SP),
             Term("linear inputs", (5 if c.autocast else 2) * comp * h, SP),
             Term("q, k, v, attention output", comp * (2 * q + 2 * kv), TP),
             probs,
             Term("SwiGLU", 4 * comp * f, TP)]
    if c.attention == "sdpa" and c.packed_documents:
        terms.append(Term("document mask", comp * c.seq_len))
        if c.repeat_kv and kv < q:  # k and v repeated to every query head, kept for backward (~7% for 7B GQA)
            terms.append(Term("k, v repeated to the query heads", 2 * comp * (q - kv), TP))
    if a.qk_norm:  # the norms' inputs and their fp32 rstd, per head
        terms.append(Term("q/k norms", c.norm_tensors * (c.norm_bytes or comp) * (q + kv) + 8 * (H + a.num_kv_heads),
                          TP))
    return terms


def selective_block_activations(a: ModelArgs, c: ActivationContext) -> list[Term]:
    """model.checkpoint="selective": the block's input and its matmuls' outputs (q, k, v, wo; w1, w2, w3), in the
    compute dtype, and the attention kernel's: flash-attn's and SDPA's output and fp32 log-sum-exp; the blocked CPU
    attention's two matmuls, the scores (w keys per query) and the output. Norms, rotary, softmax, SiLU and casts
    are recomputed. Under tensor parallel the row-parallel outputs (wo, w3) are the unreduced partial sums, [T, h]
    on every rank, and the collectives' outputs are kept too (not counted: the plain runs measured)."""
    h, kv, f, H = a.hidden_size, a.num_kv_heads * a.head_dim, a.ffn_width, a.num_heads
    q, comp = H * a.head_dim, c.compute_bytes
    if c.attention == "cpu_blocked":
        attention = Term("attention scores, output", comp * (H * keys_per_query(c.seq_len) + q), TP)
    else:
        attention = Term("attention output, log-sum-exp", comp * q + 4 * H, TP)
    return [Term("block input", c.residual_bytes * h, SP),
            Term("q, k, v", comp * (q + 2 * kv), TP), attention,
            Term("wo, w3 outputs", 2 * comp * h),
            Term("w1, w2 outputs", 2 * comp * f, TP)]


def checkpointed_block_activations(a: ModelArgs, c: ActivationContext) -> list[Term]:
    return [Term("block input", c.residual_bytes * a.hidden_size, SP)]


def shared_activations(a: ModelArgs, c: ActivationContext) -> list[Term]:
    terms = [Term("token ids", 8), Term("rotary cos, sin", 8 * a.head_dim)]
    if c.packed_documents and c.attention == "sdpa":
        terms.append(Term("document mask", c.seq_len))
    elif c.packed_documents and c.attention == "cpu_blocked":
        terms.append(Term("block document masks", keys_per_query(c.seq_len)))
    return terms


def head_activations(a: ModelArgs, c: ActivationContext) -> list[Term]:
    return [Term("final norm", c.norm_tensors * (c.norm_bytes or c.residual_bytes) * a.hidden_size + 8, SP),
            Term("output input", c.compute_bytes * a.hidden_size)]


def logits(a: ModelArgs) -> Term:
    return Term("vocabulary", a.vocab_size, TP)


COUNTS = ModelCounts(block=block, embedding=embedding, head=head, block_flops_per_token=block_flops_per_token,
                     block_activations=block_activations,
                     checkpointed_block_activations=checkpointed_block_activations,
                     selective_block_activations=selective_block_activations,
                     shared_activations=shared_activations, head_activations=head_activations, logits=logits)
