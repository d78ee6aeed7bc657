"""The MoE transformer's counts (model/counts.py) for the estimator: the dense block's attention side and norms
(internlm/counts.py), and per block the router, the experts (their weights split over "ep", the expert-parallel
dimension), the shared experts, and what routing keeps and sends.

Per token and block, with E experts of width f, k experts per token, h hidden, a compute bytes, c the capacity
factor (GShard: an expert's buffer holds c * k * tokens / E slots; dropless: k):

    router             4 * E + 8 * k           fp32 logits and probabilities, the chosen ids and weights
    routed copies      2 * c * k * a * h       each routed token's input to its expert and the expert's output
    experts' SwiGLU    4 * c * k * a * f       w1 x, silu(w1 x), w3 x, their product, for every routed copy
    all-to-all         4 * k * a * h * (1 - 1 / ep)   dispatch and combine, forward and backward, under expert
                                               parallel: each routed copy leaves the rank unless its expert is one
                                               of the rank's own (1 / ep of them under balanced routing)

A block `layer_mix` makes dense (model/moe/mix.py) is counted as the dense family's block: `layer_args` gives it
the args with `moe=None`, which every function below hands to internlm/counts.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..counts import ActivationContext, Linear, ModelCounts, Parameters, Term
from ..internlm import counts as dense

EP, TP = ("ep",), ("tp",)


def _routed(a: Any) -> float:
    """Routed copies per token: k, or the GShard buffer's c * k slots."""
    m = a.moe
    return m.top_k * (1.0 if m.moe_type == "Dropless" else max(m.capacity_factor, m.eval_capacity_factor))


def layer_args(a: Any) -> tuple[Any, ...]:
    """Each block's args: `a` for an MoE block, `a` with moe=None (the dense block's counts) for a dense one."""
    plain = dataclasses.replace(a, moe=None)
    return tuple(a if a.layer_mix.is_moe(i) else plain for i in range(a.num_layers))


def block(a: Any) -> Parameters:
    """The dense block without its FFN, the router [E, h], the experts [E, f, h] x 2 and [E, h, f] (split over
    "ep"), and InternEvo's residual MLP with its 2-way coefficient when there are shared experts."""
    base = dense.block(a)
    if a.moe is None:
        return base
    m, h = a.moe, a.hidden_size
    f, E = m.ffn_width, m.num_experts
    linears = [w for w in base.linears if not w.name.startswith("feed_forward.")]
    linears += [Linear("feed_forward.gate", E, h), Linear("feed_forward.experts.w1", E * f, h, EP),
                Linear("feed_forward.experts.w3", E * f, h, EP), Linear("feed_forward.experts.w2", h, E * f, EP)]
    others = list(base.others)
    if m.num_shared_experts:
        s = m.num_shared_experts * f
        linears += [Linear("feed_forward.shared_experts.w1", s, h), Linear("feed_forward.shared_experts.w3", s, h),
                    Linear("feed_forward.shared_experts.w2", h, s), Linear("feed_forward.coefficient", 2, h)]
        others.append(Term("coefficient bias", 2))
    return Parameters(tuple(linears), tuple(others))


def active_parameters(a: Any) -> int:
    """Parameters one token's forward multiplies: every block's but only k of its E experts, plus the embedding
    side and the head (what FLOPs per token count, as dense models count all)."""
    return sum(_active_block(b) for b in layer_args(a))


def _active_block(a: Any) -> int:
    """One block's weights a token multiplies: all but the experts, and k experts' SwiGLU."""
    weights = sum(w.elements for w in block(a).linears if not w.name.startswith("feed_forward.experts."))
    return weights + (3 * a.moe.top_k * a.moe.ffn_width * a.hidden_size if a.moe is not None else 0)


def block_flops_per_token(a: Any, seq_len: int) -> float:
    """2 per weight a token multiplies (k experts of E) and the attention's 4 * heads * head_dim * s."""
    return 2 * _active_block(a) + dense.attention_flops_per_token(a, seq_len)


def block_activations(a: Any, c: ActivationContext) -> list[Term]:
    if a.moe is None:
        return dense.block_activations(a, c)
    m, h, comp = a.moe, a.hidden_size, c.compute_bytes
    terms = [t for t in dense.block_activations(a, c) if t.name != "SwiGLU"]
    routed = _routed(a)
    terms += [Term("router", 4 * m.num_experts + 8 * m.top_k),
              Term("routed copies", 2 * routed * comp * h),
              Term("experts' SwiGLU", 4 * routed * comp * m.ffn_width)]
    if m.num_shared_experts:
        terms.append(Term("shared experts' SwiGLU", 4 * comp * m.num_shared_experts * m.ffn_width))
    return terms


def block_communication(a: Any, c: ActivationContext) -> list[Term]:
    """The all-to-all bytes a rank sends per token and block: every routed copy, less the 1 / ep share that stays
    (two terms of one name, the second divided by "ep": their sum is the whole times (1 - 1 / ep), 0 without
    expert parallel). Balanced routing is assumed; an unbalanced router sends more or less (the counter says)."""
    if a.moe is None:
        return []
    sent = 4 * a.moe.top_k * c.compute_bytes * a.hidden_size
    return [Term("expert all-to-all", sent), Term("expert all-to-all", -sent, EP)]


COUNTS = ModelCounts(block=block, embedding=dense.embedding, head=dense.head,
                     block_flops_per_token=block_flops_per_token, block_activations=block_activations,
                     checkpointed_block_activations=dense.checkpointed_block_activations,
                     shared_activations=dense.shared_activations, head_activations=dense.head_activations,
                     logits=dense.logits, block_communication=block_communication, layer_args=layer_args)


def flops_per_token(a: Any, seq_len: int) -> int:
    """Model FLOPs per trained token (the dense convention, 6 per active non-embedding parameter plus attention):
    what MFU and the throughput line count for an MoE model."""
    head = a.vocab_size * a.hidden_size
    depth = a.mtp_depth  # model.mtp: each depth one more (MoE) block, eh_proj and the head again
    mtp = depth * (_active_block(a) + 2 * a.hidden_size * a.hidden_size + head)
    return int(6 * (active_parameters(a) + head + mtp) + 12 * (a.num_layers + depth) * a.hidden_size * seq_len)
