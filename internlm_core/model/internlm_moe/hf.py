"""Hugging Face's MixtralForCausalLM for the MoE families: the Llama names for everything but the FFN, and
Mixtral's names for the router and the experts.

    layers.{i}.feed_forward.gate.weight [E, h]        model.layers.{i}.block_sparse_moe.gate.weight
    layers.{i}.feed_forward.experts.w1 [E, ffn, h]    model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight (gate)
    layers.{i}.feed_forward.experts.w3 [E, ffn, h]    ... experts.{j}.w3.weight (up)
    layers.{i}.feed_forward.experts.w2 [E, h, ffn]    ... experts.{j}.w2.weight (down)

That per-expert form is what `save_pretrained` writes and the Hub holds (transformers 5 fuses the experts in
memory, `mlp.experts.gate_up_proj` [E, 2 ffn, h] = [w1; w3] and `mlp.experts.down_proj`; that form is read too).
Mixtral routes every token to its top k experts (no capacity): our moe_type Dropless, softmax scores, top-k weights
renormalized.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Optional

import torch

from ...errors import CheckpointError
from ..internlm.hf import _common_config, config_from_llama, head_dim, llama_from_hf, llama_to_hf, refuse_options
from ..moe import layer_mix_of
from ..spec import AdapterContext, StateDictAdapter

_OURS_MOE = re.compile(r"^layers\.(\d+)\.feed_forward\.(gate\.weight|gate\.expert_bias|experts\.w[123])$")
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_HF_GATE = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight$")
_HF_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def mixtral_to_hf(sd: Mapping[str, torch.Tensor], ctx: AdapterContext) -> dict[str, torch.Tensor]:
    """Our names → Mixtral's per-expert names (the router's aux-loss-free bias, if any, has no HF counterpart)."""
    dense, out = {}, {}
    for k, v in sd.items():
        m = _OURS_MOE.match(k)
        if m is None:
            dense[k] = v
            continue
        layer, what = m.group(1), m.group(2)
        prefix = f"model.layers.{layer}.block_sparse_moe"
        if what == "gate.weight":
            out[f"{prefix}.gate.weight"] = v
        elif what.startswith("experts."):
            for j in range(v.shape[0]):
                out[f"{prefix}.experts.{j}.{what[-2:]}.weight"] = v[j]
    return {**llama_to_hf(dense, ctx), **out}


def moe_from_hf(hf: Mapping[str, torch.Tensor], ctx: AdapterContext, expert: re.Pattern, gate: re.Pattern,
                fused: re.Pattern, ours: Callable[[str], str] = lambda w: w) -> dict[str, torch.Tensor]:
    """An MoE family's HF names → ours: per-expert tensors (`expert` matches layer, expert, HF weight name; `ours`
    gives our w1/w2/w3 of that name) stacked in expert order, or the fused gate_up_proj / down_proj of newer
    transformers; the router by `gate`; the rest by the Llama block's mapping."""
    dense: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for k, v in hf.items():
        if (m := expert.match(k)) is not None:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = v
        elif (m := gate.match(k)) is not None:
            out[f"layers.{m.group(1)}.feed_forward.gate.weight"] = v
        elif (m := fused.match(k)) is not None:
            base = f"layers.{m.group(1)}.feed_forward.experts"
            if m.group(2) == "down_proj":
                out[f"{base}.w2"] = v
            else:
                out[f"{base}.w1"], out[f"{base}.w3"] = v.chunk(2, dim=1)
        else:
            dense[k] = v
    for (layer, w), by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise CheckpointError(f"layer {layer}: experts {sorted(by_index)} of {w} are not 0..N-1")
        out[f"layers.{layer}.feed_forward.experts.{ours(w)}"] = torch.stack([by_index[j] for j in range(len(by_index))])
    return {**llama_from_hf(dense, ctx), **out}


def mixtral_from_hf(hf: Mapping[str, torch.Tensor], ctx: AdapterContext) -> dict[str, torch.Tensor]:
    """Mixtral's names (per-expert or fused) → ours; experts stacked in expert order."""
    return moe_from_hf(hf, ctx, _HF_EXPERT, _HF_GATE, _HF_FUSED)


def mixtral_config(cfg: Any, torch_dtype: str = "float32",
                   special_ids: Optional[Mapping[str, Optional[int]]] = None) -> dict:
    """The config.json of a MixtralForCausalLM equivalent to `cfg` (a dropless, softmax, renormalized top-k MoE)."""
    m, r = cfg.model, cfg.moe  # cfg: ModelInputs
    if m.moe_type not in ("Dropless", "MegaBlock-Dropless") or r.score_func != "softmax" or not r.norm_topk_prob:
        raise CheckpointError(f"model.moe_type={m.moe_type} / moe.score_func={r.score_func} / moe.norm_topk_prob="
                              f"{r.norm_topk_prob}: MixtralForCausalLM routes dropless, softmax, renormalized top-k")
    if m.qkv_bias:
        raise CheckpointError("model.qkv_bias=True: MixtralForCausalLM's attention has no bias")
    if m.moe_use_residual or r.expert_bias_update_rate:
        raise CheckpointError("model.moe_use_residual / moe.expert_bias_update_rate: MixtralForCausalLM has no "
                              "shared experts or expert bias")
    refuse_options(m, "MixtralForCausalLM", allowed=("sliding_window",))
    dense = layer_mix_of(m).dense_layers(m.num_layers)
    if dense:
        raise CheckpointError(f"model.first_k_dense_replace / decoder_sparse_step / mlp_only_layers make blocks "
                              f"{list(dense)} dense: every MixtralForCausalLM layer is MoE")
    c = _common_config(cfg, torch_dtype, special_ids)
    c["intermediate_size"] = m.moe_intermediate_size or c["intermediate_size"]
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **c,
            "head_dim": head_dim(m), "num_local_experts": m.num_experts,
            "num_experts_per_tok": r.top_k, "router_aux_loss_coef": cfg.moe_loss_coeff,
            "output_router_logits": False, "router_jitter_noise": 0.0, "sliding_window": m.sliding_window,
            "attention_dropout": 0.0}


def config_from_mixtral(c: Mapping, where: str = "config.json") -> dict:
    """Our keys of a Mixtral config.json: `model` keys (top_k as InternEvo spells it in `model`: moe.top_k; the
    experts' width `intermediate_size` is model.moe_intermediate_size) and the routing of MixtralSparseMoeBlock
    (`moe.*`: softmax, renormalized top-k, no noise, no expert bias). A nonzero router_jitter_noise (transformers
    scales the whole MoE input, experts included, by U(1-j, 1+j) in training; our Jitter scales the router's input
    by a fixed 1e-2) is refused. A key config.json leaves out is transformers' MixtralConfig default
    (MIXTRAL_DEFAULTS: rms_norm_eps 1e-5, rope_theta 1e6, not Llama's)."""
    jitter = float(c.get("router_jitter_noise") or 0.0)
    if jitter:
        raise CheckpointError(f"{where}: router_jitter_noise={jitter}: Mixtral's jitter scales the experts' input "
                              "too, which internlm-core's routers do not (moe.noisy_gate_policy Jitter scales the "
                              "router's input by U(0.99, 1.01)); set it to 0.0 in config.json to load the folder")
    out = config_from_llama({**MIXTRAL_DEFAULTS, **{k: v for k, v in c.items() if v is not None},
                             "attention_bias": False}, where)
    out["sliding_window"] = int(c["sliding_window"]) if c.get("sliding_window") else None
    out.update(num_experts=int(c.get("num_local_experts", 8)), top_k=int(c.get("num_experts_per_tok", 2)),
               moe_type="Dropless", moe_intermediate_size=out.pop("intermediate_size"))
    out.update(MIXTRAL_ROUTING, **{"moe.norm_topk_prob": True})
    out.update(ALL_MOE)  # every layer MoE
    return out


# transformers' MixtralConfig defaults that differ from LlamaConfig's (what a config.json without the key means)
MIXTRAL_DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 1e6}


# the router of Mixtral's and Qwen3-MoE's HF classes, in our moe section's keys (compared on import)
MIXTRAL_ROUTING = {"moe.score_func": "softmax", "moe.noisy_gate_policy": None, "moe.expert_bias_update_rate": 0.0,
                   "moe_use_residual": False}


# model/moe/mix.py's keys of a class whose every layer is MoE
ALL_MOE = {"first_k_dense_replace": 0, "decoder_sparse_step": 1, "mlp_only_layers": []}


MIXTRAL_HF = StateDictAdapter(format="hf", to_foreign=mixtral_to_hf, from_foreign=mixtral_from_hf,
                              foreign_config=mixtral_config, config_from_foreign=config_from_mixtral,
                              architectures=("MixtralForCausalLM",), hf_model_types=("mixtral",),
                              description="Hugging Face MixtralForCausalLM")
