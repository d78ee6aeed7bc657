"""InternEvo's INTERNLM_MoE checkpoint names (its modeling_moe.py), both ways.

The dense part of the block is InternLM v1's (mixer.Wqkv, out_proj, norm1/norm2, embedding, head: the INTERNLM
family's internlm_ckpt.py merges and splits it). The feed-forward is InternEvo's `MoE` module:

    blocks.{i}.mlp.moe_layer.gate.wg.weight                         [E, H]   the router; replicated
    blocks.{i}.mlp.moe_layer.experts.wrapped_experts.{e}.w{1,2,3}    one FeedForward per expert
    blocks.{i}.mlp.residual_mlp.w{1,2,3}.weight                      moe_use_residual: the residual MLP
    blocks.{i}.mlp.coefficient.{weight,bias}                         its mixing coefficients; replicated

InternEvo saves the experts outside `model_tp{t}_pp{p}.pt`, one file per (layer, expert, expert tensor rank):
`model_moe_layer{L}_expert{e}_tp{t}.pt`; checkpoint/internlm_format.py reads and writes those files and hands this
adapter one state dict per tensor rank with the experts in it. Experts saved with `parallel.expert.no_tp=True` exist
for tensor rank 0 only: they are whole there.

InternEvo's FeedForward changed its names: early MoE releases (internlm/model/linear.py) had w1, w2 column parallel
(gate, up) and w3 row parallel (down), as InternLM v1; later ones (internlm/model/modules/mlp.py) have w1 gate, w3
up, w2 down, as Llama. The shapes tell them apart ([F, H] up, [H, F] down) unless the FFN width per tensor rank
equals the hidden size; then the later names are assumed. Written folders use the later names.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

from ...errors import CheckpointError
from ..internlm.internlm_ckpt import config_from_internlm_ckpt, from_internlm, internlm_model_config, to_internlm
from ..moe import layer_mix_of
from ..spec import AdapterContext, StateDictAdapter

_OURS = re.compile(r"^layers\.(\d+)\.feed_forward\.(.+)$")
_EXPERT = re.compile(r"^blocks\.(\d+)\.mlp\.moe_layer\.experts\.wrapped_experts\.(\d+)\.(w[123])\.weight$")
_RESIDUAL = re.compile(r"^blocks\.(\d+)\.mlp\.residual_mlp\.(w[123])\.weight$")
EXPERT_KEY = "blocks.{layer}.mlp.moe_layer.experts.wrapped_experts.{expert}.{w}.weight"


def _gate_up_down(parts: Mapping[str, list[torch.Tensor]], hidden: int, where: str) -> dict[str, torch.Tensor]:
    """One FeedForward's tensor shards {w1, w2, w3: [shard per rank]} → our {w1 gate, w3 up, w2 down}, whichever
    naming saved it (module docstring): column shards concatenated along dim 0, row shards along dim 1."""
    if set(parts) != {"w1", "w2", "w3"}:
        raise CheckpointError(f"{where}: expected w1, w2 and w3, found {sorted(parts)}")
    # unlike the dense reader, an undecidable shape means the later names here (InternEvo's MoE is its own)
    w2, w3 = parts["w2"][0], parts["w3"][0]
    v1_names = w2.shape[1] == hidden and w3.shape[0] == hidden and w2.shape[0] != hidden  # w2 up, w3 down
    up, down = ("w2", "w3") if v1_names else ("w3", "w2")
    return {"w1": torch.cat(parts["w1"], dim=0), "w3": torch.cat(parts[up], dim=0),
            "w2": torch.cat(parts[down], dim=1)}


def _shards_with(states: list[Mapping[str, torch.Tensor]], key: str) -> list[torch.Tensor]:
    """`key`'s shards over the tensor ranks that hold it (experts saved with no_tp: rank 0 alone)."""
    return [s[key] for s in states if key in s]


def from_internevo_moe(shards: Mapping[int, Mapping[str, torch.Tensor]], ctx: AdapterContext) -> dict[str, torch.Tensor]:
    """{tensor rank: InternEvo's names} → ours: the dense part by InternLM v1's rules, then the MoE feed-forward."""
    out = from_internlm(shards, ctx)
    states = [shards[r] for r in range(len(shards))]
    hidden = ctx.args.hidden_size
    experts: dict[tuple[int, int], dict[str, list[torch.Tensor]]] = {}
    residual: dict[int, dict[str, list[torch.Tensor]]] = {}
    for key in sorted({k for s in states for k in s}):
        if (m := _EXPERT.match(key)) is not None:
            experts.setdefault((int(m.group(1)), int(m.group(2))), {})[m.group(3)] = _shards_with(states, key)
        elif (m := _RESIDUAL.match(key)) is not None:
            residual.setdefault(int(m.group(1)), {})[m.group(2)] = _shards_with(states, key)
        elif key.endswith(".mlp.moe_layer.gate.wg.weight"):
            out[f"layers.{key.split('.')[1]}.feed_forward.gate.weight"] = states[0][key]
        elif ".mlp.coefficient." in key:
            out[f"layers.{key.split('.')[1]}.feed_forward.coefficient.{key.rsplit('.', 1)[1]}"] = states[0][key]
    by_layer: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for (layer, e), parts in experts.items():
        by_layer.setdefault(layer, {})[e] = _gate_up_down(parts, hidden, f"layer {layer} expert {e}")
    for layer, per_expert in by_layer.items():
        if sorted(per_expert) != list(range(len(per_expert))):
            raise CheckpointError(f"layer {layer}: experts {sorted(per_expert)} found, expected 0..N-1 (a "
                                  f"model_moe_layer{layer}_expert*_tp*.pt file is missing)")
        for w in ("w1", "w2", "w3"):
            out[f"layers.{layer}.feed_forward.experts.{w}"] = torch.stack(
                [per_expert[e][w] for e in range(len(per_expert))])
    for layer, parts in residual.items():
        for w, t in _gate_up_down(parts, hidden, f"layer {layer} residual_mlp").items():
            out[f"layers.{layer}.feed_forward.shared_experts.{w}.weight"] = t
    return out


def _split(t: torch.Tensor, tp: int, dim: int) -> list[torch.Tensor]:
    if t.shape[dim] % tp:
        raise CheckpointError(f"a tensor of shape {tuple(t.shape)} cannot be split {tp} ways along dim {dim}")
    return list(torch.chunk(t, tp, dim=dim))


def to_internevo_moe(sd: Mapping[str, torch.Tensor], ctx: AdapterContext) -> dict[int, dict[str, torch.Tensor]]:
    """Our state dict (whole layers) → {tensor rank: InternEvo's names}, experts tensor-sharded as InternEvo's
    default (parallel.expert.no_tp=False) saves them."""
    tp = ctx.tp
    dense = {k: v for k, v in sd.items() if not _OURS.match(k)}
    out = to_internlm(dense, ctx)
    for key, v in sd.items():
        m = _OURS.match(key)
        if m is None:
            continue
        layer, what = int(m.group(1)), m.group(2)
        pre = f"blocks.{layer}.mlp."
        dims = {"w1": 0, "w3": 0, "w2": 1}
        if what == "gate.weight":
            shards = [v] * tp
            names = [pre + "moe_layer.gate.wg.weight"]
        elif what.startswith("coefficient."):
            shards, names = [v] * tp, [pre + what]
        elif what.startswith("shared_experts."):
            w = what.split(".")[1]
            shards, names = _split(v, tp, dims[w]), [pre + f"residual_mlp.{w}.weight"]
        elif what.startswith("experts."):
            w = what.split(".")[1]
            for e in range(v.shape[0]):
                for r, shard in enumerate(_split(v[e], tp, dims[w])):
                    out[r][EXPERT_KEY.format(layer=layer, expert=e, w=w)] = shard.contiguous()
            continue
        else:
            raise CheckpointError(f"parameter {key!r} has no InternEvo checkpoint name (the aux-loss-free expert "
                                  f"bias has none: InternEvo's MoE has no such bias)")
        for r in range(tp):
            out[r][names[0]] = shards[r].contiguous()
    return out


def internevo_moe_config(cfg, torch_dtype: str = "bfloat16", special_ids=None) -> dict:
    """model_config.pt: InternLM v1's keys plus the MoE ones InternEvo's model section has."""
    m = cfg.model
    dense = layer_mix_of(m).dense_layers(m.num_layers)
    if dense:
        raise CheckpointError(f"model.first_k_dense_replace / decoder_sparse_step / mlp_only_layers make blocks "
                              f"{list(dense)} dense: InternEvo's MoE checkpoint holds an MoE FFN in every block")
    out = internlm_model_config(cfg, torch_dtype, special_ids)
    out.update({"num_experts": m.num_experts, "moe_use_residual": bool(m.moe_use_residual), "moe_type": m.moe_type})
    return out


INTERNEVO_MOE_CKPT = StateDictAdapter(
    format="internlm", to_foreign=to_internevo_moe, from_foreign=from_internevo_moe,
    foreign_config=internevo_moe_config, config_from_foreign=config_from_internlm_ckpt,
    description="InternEvo INTERNLM_MoE checkpoint folder (model_tp{t}_pp{p}.pt + model_moe_layer{L}_expert{e}_tp{t}.pt)")
