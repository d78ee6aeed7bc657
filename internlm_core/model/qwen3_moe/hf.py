"""Qwen3-MoE's Hugging Face form, `Qwen3MoeForCausalLM`: Qwen3's attention (q/k norms, head_dim 128, Llama's
names: qwen3/hf.py) and Qwen's names for the router and the experts.

    layers.{i}.feed_forward.gate.weight [E, h]        model.layers.{i}.mlp.gate.weight
    layers.{i}.feed_forward.experts.w1 [E, ffn, h]    model.layers.{i}.mlp.experts.{j}.gate_proj.weight
    layers.{i}.feed_forward.experts.w3 [E, ffn, h]    ... experts.{j}.up_proj.weight
    layers.{i}.feed_forward.experts.w2 [E, h, ffn]    ... experts.{j}.down_proj.weight

The per-expert form is what `save_pretrained` writes and the Hub holds; transformers 5 fuses the experts in memory
(`mlp.experts.gate_up_proj` [E, 2 ffn, h] = [gate; up], `mlp.experts.down_proj` [E, h, ffn]), which is read too.
Routing: softmax scores in fp32, top k, renormalized when `norm_topk_prob` (our moe.norm_topk_prob), every token
kept (moe_type Dropless). The dense layers of `decoder_sparse_step` / `mlp_only_layers` (Qwen3MoeMLP of width
`intermediate_size`) are our dense blocks (model/moe/mix.py, the same keys): the Llama names,
`model.layers.{i}.mlp.{gate,up,down}_proj.weight`. A config's first_k_dense_replace is written as mlp_only_layers.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

import torch

from ...errors import CheckpointError
from ..args import ffn_width
from ..internlm.hf import _common_config, head_dim, llama_to_hf, refuse_options
from ..internlm_moe.hf import MIXTRAL_ROUTING, moe_from_hf
from ..moe import layer_mix_of
from ..qwen2.hf import window_config
from ..qwen3.hf import config_from_qwen3
from ..spec import AdapterContext, StateDictAdapter

_OURS_MOE = re.compile(r"^layers\.(\d+)\.feed_forward\.(gate\.weight|gate\.expert_bias|experts\.w[123])$")
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_HF_GATE = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate\.weight$")
_HF_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_W = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # ours -> Qwen's (SwiGLU: w2(silu(w1 x) * w3 x))
_OURS_W = {v: k for k, v in _W.items()}


def qwen3_moe_to_hf(sd: Mapping[str, torch.Tensor], ctx: AdapterContext) -> dict[str, torch.Tensor]:
    """Our names → Qwen3-MoE's per-expert names (the aux-loss-free expert bias has no HF counterpart)."""
    dense, out = {}, {}
    for k, v in sd.items():
        m = _OURS_MOE.match(k)
        if m is None:
            dense[k] = v
            continue
        prefix, what = f"model.layers.{m.group(1)}.mlp", m.group(2)
        if what == "gate.weight":
            out[f"{prefix}.gate.weight"] = v
        elif what.startswith("experts."):
            for j in range(v.shape[0]):
                out[f"{prefix}.experts.{j}.{_W[what[-2:]]}.weight"] = v[j]
    return {**llama_to_hf(dense, ctx), **out}


def qwen3_moe_from_hf(hf: Mapping[str, torch.Tensor], ctx: AdapterContext) -> dict[str, torch.Tensor]:
    """Qwen3-MoE's names (per-expert or fused) → ours; experts stacked in expert order."""
    return moe_from_hf(hf, ctx, _HF_EXPERT, _HF_GATE, _HF_FUSED, ours=lambda w: _OURS_W[w])


def qwen3_moe_config(cfg: Any, torch_dtype: str = "float32",
                     special_ids: Optional[Mapping[str, Optional[int]]] = None) -> dict:
    """The config.json of a Qwen3MoeForCausalLM equivalent to `cfg` (ModelInputs): dropless softmax top-k."""
    m, r = cfg.model, cfg.moe
    if m.moe_type not in ("Dropless", "MegaBlock-Dropless") or r.score_func != "softmax":
        raise CheckpointError(f"model.moe_type={m.moe_type} / moe.score_func={r.score_func}: Qwen3MoeForCausalLM "
                              "routes dropless over softmax scores")
    if m.moe_use_residual or r.expert_bias_update_rate:
        raise CheckpointError("model.moe_use_residual / moe.expert_bias_update_rate: Qwen3MoeForCausalLM has no "
                              "shared experts or expert bias")
    refuse_options(m, "Qwen3MoeForCausalLM", allowed=("qk_norm", "sliding_window"))
    if not m.qk_norm:
        raise CheckpointError("model.qk_norm=False: Qwen3MoeForCausalLM always normalizes q and k")
    c = _common_config(cfg, torch_dtype, special_ids)
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **c, "head_dim": head_dim(m),
            "attention_bias": bool(m.qkv_bias), **window_config(m), "attention_dropout": 0.0,
            "moe_intermediate_size": m.moe_intermediate_size or ffn_width(m), "num_experts": m.num_experts,
            "num_experts_per_tok": r.top_k, "norm_topk_prob": bool(r.norm_topk_prob), **_mix_config(m),
            "router_aux_loss_coef": cfg.moe_loss_coeff, "output_router_logits": False}


def _mix_config(m: Any) -> dict:
    """decoder_sparse_step and mlp_only_layers holding the config's dense blocks (first_k_dense_replace's among
    the listed ones)."""
    mix = layer_mix_of(m)
    dense = sorted(set(mix.mlp_only_layers) | set(range(min(mix.first_k_dense_replace, m.num_layers))))
    return {"decoder_sparse_step": mix.decoder_sparse_step, "mlp_only_layers": dense}


def config_from_qwen3_moe(c: Mapping, where: str = "config.json") -> dict:
    """Our keys of a Qwen3-MoE config.json: `model` keys, and moe.norm_topk_prob (another section: dotted)."""
    step, dense_layers = c.get("decoder_sparse_step", 1), c.get("mlp_only_layers") or []
    if isinstance(step, bool) or not isinstance(step, int) or not isinstance(dense_layers, list):
        raise CheckpointError(f"{where}: decoder_sparse_step={step!r}, mlp_only_layers={dense_layers!r}: expected "
                              "an int and a list of layer indices")
    # Qwen3MoeConfig's head_dim default: width / heads; Qwen3MoeAttention windows every layer when
    # use_sliding_window (max_window_layers is not read)
    out = config_from_qwen3({"head_dim": None, **c, "max_window_layers": 0, "layer_types": None}, where)
    if step == 1 and not dense_layers:
        del out["intermediate_size"]  # the dense layers' width: no layer has it
    # the class has no first_k_dense_replace (0): a run's other value would build another model
    out.update(first_k_dense_replace=0, decoder_sparse_step=step, mlp_only_layers=sorted(int(i) for i in dense_layers))
    experts = _need({"num_experts": c.get("num_local_experts"), **c}, "num_experts", where)
    out.update(num_experts=int(experts), top_k=int(c.get("num_experts_per_tok", 8)), moe_type="Dropless",
               moe_intermediate_size=int(_need(c, "moe_intermediate_size", where)))
    out["moe.norm_topk_prob"] = bool(c.get("norm_topk_prob", False))  # transformers' default: not renormalized
    out.update(MIXTRAL_ROUTING)
    return out


def _need(c: Mapping, key: str, where: str) -> Any:
    if c.get(key) is None:  # transformers 5 writes num_experts as num_local_experts (its attribute_map)
        raise CheckpointError(f"{where}: missing key {key!r}")
    return c[key]


QWEN3_MOE_HF = StateDictAdapter(format="hf", to_foreign=qwen3_moe_to_hf, from_foreign=qwen3_moe_from_hf,
                                foreign_config=qwen3_moe_config, config_from_foreign=config_from_qwen3_moe,
                                architectures=("Qwen3MoeForCausalLM",), hf_model_types=("qwen3_moe",),
                                description="Hugging Face Qwen3MoeForCausalLM")
