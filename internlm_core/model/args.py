"""ModelArgs: the shape and numerics of one decoder-only transformer, shared by the families built on it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


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
    )


def analytic_parameter_count(a: ModelArgs) -> int:
    """The parameter count from the shape alone (checks `count_parameters` and feeds FLOPs estimates)."""
    h, kv = a.hidden_size, a.num_kv_heads * a.head_dim
    attn = h * h + 2 * h * kv + h * h + (h + 2 * kv + h if a.qkv_bias else 0)
    ffn = 3 * h * a.ffn_width
    per_layer = attn + ffn + 2 * h
    embed = a.vocab_size * h
    head = 0 if a.tie_word_embeddings else a.vocab_size * h
    return a.num_layers * per_layer + embed + head + h


def flops_per_token(a: ModelArgs, seq_len: int) -> int:
    """Model FLOPs per trained token: 6*N_nonembedding (lm_head included) + 12*L*h*s.

    The PaLM convention, as the peer benchmark: the input embedding is a lookup and not counted,
    attention scores and values count the full s*s square (not halved for causal), activation
    recomputation is not counted (model FLOPs, not hardware FLOPs).
    """
    n = analytic_parameter_count(a) - a.vocab_size * a.hidden_size
    if a.tie_word_embeddings:  # the shared matrix is still used as the lm_head matmul
        n += a.vocab_size * a.hidden_size
    return 6 * n + 12 * a.num_layers * a.hidden_size * seq_len
