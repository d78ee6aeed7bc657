"""Multi-token prediction (DeepSeek-V3's MTP, `model.mtp`), for any family built on a block of its own.

Depth k = 1 .. D has one `MTPDepth`: at every position i it takes the previous depth's hidden state h_{k-1}
(h_0: the main model's last hidden state BEFORE its final norm) and the embedding of the token at i + k, and

    x   = eh_proj([enorm(Emb(t_{i+k})); hnorm(h_{k-1})])      eh_proj: 2H -> H, no bias
    h_k = block_k(x)                                          one block of the family (its attention, its FFN)
    logits_k = output(norm_k(h_k))                            the SHARED output layer, a final norm of its own

and position i of depth k predicts the token at i + k + 1. The order [embedding; hidden] is the published
checkpoints' (vLLM's and SGLang's DeepSeek MTP layers: `eh_proj(cat([enorm(e), hnorm(h)]))`; the paper writes
the other order); the embedding is the model's own (`tok_embeddings`), as is the output layer.

Targets (`mtp_targets`): built from the whole packed row, before any context-parallel cut, per depth k:
    ids[i, k-1]    = input_ids[i + k]   where i + k lies in i's document, else 0 (a position whose target is -100;
                     under causal attention within the document no counted position attends to it)
    labels[i, k-1] = labels[i + k]      where i + k lies in i's document, else -100
labels[i + k] is the token at i + k + 1 (or -100 at the document's end and wherever the data masks the loss), so
depth k never reads nor predicts a token of another document, and a loss mask of the data holds for every depth.

The loss (the trainer's, trainer/mtp.py): loss_weight * (1 / D) * sum_k CE_k, each CE_k a token mean over its
depth's counted targets, normalized by the loss contract (loss_norm.py) as the main loss is; added to the main
loss for the backward, reported on its own as `mtp_loss` (the mean over depths of CE_k, before loss_weight).

Pipeline parallel: the depths run on the last stage, after the main blocks. The first stage looks up the depths'
embeddings (the one embedding: its gradient reaches it through the pipeline, tied or not) and sends them on with the
hidden states, concatenated along the channels ([.., H * (1 + D)], `carry` / `uncarry`); a middle stage passes them
through. That is D * H more values per token between stages, instead of a copy of the embedding on the last stage
whose gradients must be summed with the first stage's every step (Megatron's shared-embedding group).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from ..errors import ConfigError
from .counts import ActivationContext, ModelCounts, Parameters, Term
from .counts import Linear as LinearCount
from .layers import Linear, RMSNorm

_KEYS = ("depth", "loss_weight")
# a micro-batch's depth targets (mtp_targets), [rows, T, D] each: cut along the sequence like its rows, on the device
MTP_KEYS = ("mtp_ids", "mtp_labels")
DEFAULT_LOSS_WEIGHT = 0.3  # DeepSeek-V3's lambda for its first 10T tokens (0.1 after)


@dataclass(frozen=True)
class MTPSettings:
    """`model.mtp` resolved: depth D (0: off) and the weight of the MTP loss in the trained loss."""

    depth: int = 0
    loss_weight: float = DEFAULT_LOSS_WEIGHT

    @property
    def on(self) -> bool:
        return self.depth > 0


def mtp_settings(value: Any) -> MTPSettings:
    """`model.mtp` as given: None / False / 0 (off), a depth (int), or dict(depth, loss_weight); ConfigError
    naming the key otherwise."""
    if value is None or value is False or (isinstance(value, int) and not isinstance(value, bool) and value == 0):
        return MTPSettings()
    if isinstance(value, int) and not isinstance(value, bool):
        value = {"depth": value}
    if not isinstance(value, dict):
        raise ConfigError(f"model.mtp: expected None, a depth (int) or dict(depth, loss_weight), got {value!r}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ConfigError(f"model.mtp.{unknown[0]}: unknown key; expected {', '.join(_KEYS)}")
    depth = value.get("depth", 1)
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ConfigError(f"model.mtp.depth: expected an int >= 0 (0: off), got {depth!r}")
    weight = value.get("loss_weight", DEFAULT_LOSS_WEIGHT)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0.0 <= float(weight) < float("inf"):
        raise ConfigError(f"model.mtp.loss_weight: expected a number >= 0, got {weight!r}")
    return MTPSettings(depth, float(weight))


def mtp_targets(input_ids: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor, depth: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels) [rows, T, depth] of the depths (module docstring) from WHOLE packed rows [rows, T]:
    `document_ids` [rows, T] the document of each token. Shifted within each document only."""
    rows, T = input_ids.shape
    ids = torch.zeros(rows, T, depth, dtype=input_ids.dtype, device=input_ids.device)
    out = torch.full((rows, T, depth), -100, dtype=labels.dtype, device=labels.device)
    for k in range(1, min(depth, T - 1) + 1):
        same = document_ids[:, k:] == document_ids[:, :T - k]  # i + k in i's document
        ids[:, :T - k, k - 1] = torch.where(same, input_ids[:, k:], torch.zeros_like(input_ids[:, k:]))
        out[:, :T - k, k - 1] = torch.where(same, labels[:, k:], torch.full_like(labels[:, k:], -100))
    return ids, out


class MTPDepth(nn.Module):
    """One depth: enorm, hnorm, eh_proj, the family's block, and its own final norm (HF: shared_head.norm)."""

    def __init__(self, hidden: int, eps: float, fp32_norm: bool, block: nn.Module):
        super().__init__()
        self.enorm = RMSNorm(hidden, eps, fp32_norm)
        self.hnorm = RMSNorm(hidden, eps, fp32_norm)
        self.eh_proj = Linear(2 * hidden, hidden, bias=False)
        self.block = block
        self.norm = RMSNorm(hidden, eps, fp32_norm)


class MultiTokenPrediction(nn.Module):
    """The D depths (`depths.{k-1}`). `forward` returns each depth's logits; the model keeps them in `pending`
    for the trainer's loss (`pop_mtp_logits`): the model's own output stays the main logits, so every pipeline
    schedule and evaluation path is unchanged."""

    def __init__(self, depth: int, hidden: int, eps: float, fp32_norm: bool, make_block: Callable[[int], nn.Module]):
        super().__init__()
        self.depths = nn.ModuleDict({str(k): MTPDepth(hidden, eps, fp32_norm, make_block(k)) for k in range(depth)})
        self.hidden = hidden
        self.pending: list[torch.Tensor] = []

    def forward(self, h: torch.Tensor, embeddings: torch.Tensor, output: nn.Module,
                run_block: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        """h: the main model's last hidden state (before its final norm) [B, T, H]; embeddings [B, T, D * H]: the
        depths' token embeddings (`embed_depths`); output: the shared output layer; run_block(block, x): the
        family's block on x with the main model's positions and attention layout."""
        logits = []
        for k, depth in enumerate(self.depths.values()):
            e = embeddings[..., k * self.hidden:(k + 1) * self.hidden]
            x = depth.eh_proj(torch.cat([depth.enorm(e), depth.hnorm(h)], dim=-1))
            h = run_block(depth.block, x)
            logits.append(output(depth.norm(h)))
        return logits


def build_mtp(args: Any, make_block: Callable[[int], nn.Module]) -> Optional[MultiTokenPrediction]:
    """The model's MTP module (None when args.mtp_depth is 0); make_block(k): the family's block of depth k + 1
    (a family numbers it num_layers + k, e.g. for which blocks are MoE)."""
    if not args.mtp_depth:
        return None
    return MultiTokenPrediction(args.mtp_depth, args.hidden_size, args.norm_eps, args.use_fp32_norm, make_block)


def embed_depths(embed: Callable[[torch.Tensor], torch.Tensor], mtp_ids: torch.Tensor) -> torch.Tensor:
    """[B, T, D * H]: the embedding of each depth's ids (mtp_ids [B, T, D]), concatenated along the channels."""
    return torch.cat([embed(mtp_ids[..., k]) for k in range(mtp_ids.shape[-1])], dim=-1)


def uncarry(h: torch.Tensor, hidden: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A later pipeline stage's input: (hidden states, the depths' embeddings the first stage sent, or None)."""
    if h.is_floating_point() and h.shape[-1] > hidden:
        return h[..., :hidden], h[..., hidden:]
    return h, None


def carry(h: torch.Tensor, embeddings: Optional[torch.Tensor]) -> torch.Tensor:
    """A stage's output to the next stage: the hidden states with the depths' embeddings (module docstring)."""
    return h if embeddings is None else torch.cat([h, embeddings], dim=-1)


def model_extras(mb: dict) -> dict:
    """The model's keyword inputs beyond ids, positions and documents that the micro-batch `mb` holds (mtp_ids)."""
    return {"mtp_ids": mb["mtp_ids"]} if "mtp_ids" in mb else {}


def mtp_module(model: nn.Module) -> Optional[MultiTokenPrediction]:
    """The model's MTP module on this rank (None: off, or not on this pipeline stage)."""
    return next((m for m in model.modules() if isinstance(m, MultiTokenPrediction)), None)


def mtp_blocks(model: nn.Module) -> list[nn.Module]:
    """The depths' blocks this rank holds: units of activation checkpointing, compile and FSDP like the others."""
    m = getattr(model, "mtp", None)
    return [d.block for d in m.depths.values()] if isinstance(m, MultiTokenPrediction) else []


def pop_mtp_logits(module: Optional[MultiTokenPrediction]) -> list[torch.Tensor]:
    """The logits of each depth of the last forward (then forgotten); [] when it ran none."""
    if module is None:
        return []
    out, module.pending = module.pending, []
    return out


def mtp_counts(counts: ModelCounts) -> ModelCounts:
    """A family's counts (model/counts.py) with model.mtp's depths on the head side (the last pipeline stage) when
    the args have depths: per depth the family's block (`counts.block`, as its blocks numbered num_layers + k),
    eh_proj (2H -> H) and three norms; what each depth keeps for backward: its block's activations, eh_proj's input,
    the norms, and its logits with the gradient the fused cross entropy stores beside them (2 x the logits)."""

    def head(a: Any) -> Parameters:
        base, depth = counts.head(a), getattr(a, "mtp_depth", 0)
        if not depth:
            return base
        block, h = counts.block(a), a.hidden_size
        linears = tuple(replace(w, name=f"mtp.depths.{k}.block.{w.name}") for k in range(depth) for w in block.linears)
        linears += tuple(LinearCount(f"mtp.depths.{k}.eh_proj", h, 2 * h) for k in range(depth))
        others = tuple(replace(t, name=f"mtp.depths.{k}.block.{t.name}") for k in range(depth) for t in block.others)
        return Parameters(base.linears + linears, base.others + others + (Term("mtp norms", 3 * h * depth),))

    def head_activations(a: Any, ctx: ActivationContext) -> list[Term]:
        base, depth = counts.head_activations(a, ctx), getattr(a, "mtp_depth", 0)
        if not depth:
            return base
        h, logits = a.hidden_size, counts.logits(a)
        norm = ctx.norm_tensors * (ctx.norm_bytes or ctx.residual_bytes) * h + 8
        per_depth = counts.block_activations(a, ctx) + [
            Term("mtp eh_proj input", 2 * ctx.compute_bytes * h), Term("mtp norms", 3 * norm),
            Term("mtp logits and their stored gradient", 2 * ctx.compute_bytes * logits.value, logits.shard)]
        return base + [replace(t, value=t.value * depth) for t in per_depth]

    return replace(counts, head=head, head_activations=head_activations)
