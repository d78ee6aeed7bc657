"""ModelArgs: the shape and numerics of one decoder-only transformer, shared by the families built on it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .mtp import mtp_settings


@dataclass
class ModelArgs:
    """The shape and numerics of one model, resolved from the config's `model` section."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_width: int
    max_seqlen: int
    qkv_bias: bool = False
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    tie_word_embeddings: bool = False
    init_std: float = 0.02
    embed_grad_scale: float = 1.0
    apply_post_layer_norm: bool = False
    use_fp32_norm: bool = False
    attn_backend: str = "sdpa"
    # options of the shared block some families turn on; the defaults are the InternLM / Llama block
    out_bias: Optional[bool] = None           # bias on wo; None: as qkv_bias (Qwen2: q/k/v biased, wo not)
    qk_norm: bool = False                     # RMSNorm over head_dim on q and k before the rotary (Qwen3)
    sliding_window: Optional[int] = None      # each query sees at most this many keys, itself included (Mistral)
    window_layers: Optional[tuple] = None     # the layers sliding_window applies to (None: every layer)
    rope_scaling: Optional[dict] = None       # linear / dynamic / llama3 frequency scaling (model.rope_scaling)
    attention_head_dim: Optional[int] = None  # None: hidden_size / num_heads (Qwen3: 128 whatever the width)
    mtp_depth: int = 0                        # multi-token prediction depths (model.mtp, model/mtp.py); 0: off

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_heads

    @property
    def wo_bias(self) -> bool:
        return bool(self.qkv_bias if self.out_bias is None else self.out_bias)


def ffn_width(m: Any) -> int:
    """InternLM's FeedForward width: int(hidden * mlp_ratio) rounded up to `multiple_of` (or `intermediate_size`)."""
    if m.intermediate_size is not None:
        return m.intermediate_size
    hidden = int(m.hidden_size * m.mlp_ratio)
    return m.multiple_of * ((hidden + m.multiple_of - 1) // m.multiple_of)


def args_from_model_config(m: Any, seq_len: int, attn_backend: str = "sdpa") -> ModelArgs:
    """ModelArgs from a `model` config section (duck-typed: ModelConfig) and the data's `seq_len`."""
    return ModelArgs(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
        num_heads=m.num_attention_heads, num_kv_heads=m.num_kv_attention_heads, ffn_width=ffn_width(m),
        max_seqlen=seq_len, qkv_bias=bool(m.qkv_bias), norm_eps=m.layer_norm_epsilon,
        rope_base=m.rope_base, tie_word_embeddings=m.tie_word_embeddings, init_std=m.init_std,
        embed_grad_scale=m.embed_grad_scale, apply_post_layer_norm=m.apply_post_layer_norm,
        use_fp32_norm=m.use_fp32_norm, attn_backend=attn_backend,
        qk_norm=bool(m.qk_norm), sliding_window=m.sliding_window,
        window_layers=tuple(int(i) for i in m.window_layers) if m.window_layers is not None else None,
        rope_scaling=dict(m.rope_scaling) if m.rope_scaling else None,
        attention_head_dim=m.head_dim, mtp_depth=mtp_settings(m.mtp).depth,
    )


def analytic_parameter_count(a: ModelArgs) -> int:
    """The parameter count from the shape alone (checks `count_parameters` and feeds FLOPs estimates)."""
    h, q, kv = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    attn = 2 * h * q + 2 * h * kv + (q + 2 * kv if a.qkv_bias else 0) + (h if a.wo_bias else 0)
    attn += 2 * a.head_dim if a.qk_norm else 0
    ffn = 3 * h * a.ffn_width
    per_layer = attn + ffn + 2 * h
    embed = a.vocab_size * h
    head = 0 if a.tie_word_embeddings else a.vocab_size * h
    mtp = a.mtp_depth * (per_layer + 2 * h * h + 3 * h)  # model.mtp: a block, eh_proj and 3 norms per depth
    return a.num_layers * per_layer + embed + head + h + mtp


def flops_per_token(a: ModelArgs, seq_len: int) -> int:
    """Model FLOPs per trained token: 6*N_nonembedding (lm_head included) + 12*L*(heads*head_dim)*s.

    The PaLM convention, as the peer benchmark: the input embedding is a lookup and not counted,
    attention scores and values count the full s*s square (not halved for causal; s*w under a sliding window
    of w keys), activation recomputation is not counted (model FLOPs, not hardware FLOPs).
    """
    n = analytic_parameter_count(a) - a.vocab_size * a.hidden_size
    if a.tie_word_embeddings:  # the shared matrix is still used as the lm_head matmul
        n += a.vocab_size * a.hidden_size
    keys = min(seq_len, a.sliding_window) if a.sliding_window else seq_len  # a query sees at most the window
    windowed = a.num_layers if a.window_layers is None else len(set(a.window_layers))  # the others see seq_len
    n += a.mtp_depth * a.vocab_size * a.hidden_size  # model.mtp: each depth multiplies the shared output layer
    return 6 * n + 12 * a.num_heads * a.head_dim * (windowed * keys + (a.num_layers - windowed) * seq_len
                                                   + a.mtp_depth * keys)  # the depths' blocks: as windowed ones
