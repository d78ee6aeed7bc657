"""DeepSeek-V3's Hugging Face form, `DeepseekV3ForCausalLM` (also Kimi-K2's and Moonlight's folders).

    layers.{i}.attention.wq / wq_a / q_a_norm / wq_b   model.layers.{i}.self_attn.q_proj / q_a_proj / q_a_layernorm /
                                                       q_b_proj
    layers.{i}.attention.wkv_a / kv_a_norm / wkv_b     ... self_attn.kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj
    layers.{i}.attention.wo                            ... self_attn.o_proj
    layers.{i}.attention_norm / ffn_norm               ... input_layernorm / post_attention_layernorm
    layers.{i}.feed_forward.w1 / w2 / w3 (dense)       ... mlp.gate_proj / up_proj / down_proj
    layers.{i}.feed_forward.gate.weight / expert_bias  ... mlp.gate.weight / mlp.gate.e_score_correction_bias
    layers.{i}.feed_forward.experts.w1 / w3 / w2       ... mlp.experts.{j}.gate_proj / up_proj / down_proj (stacked;
                                                       transformers 5's fused gate_up_proj / down_proj read too)
    layers.{i}.feed_forward.shared_experts.w1/w3/w2    ... mlp.shared_experts.gate_proj / up_proj / down_proj
    tok_embeddings / norm / output                     model.embed_tokens / model.norm / lm_head

Rotary: DeepSeek's published weights rotate interleaved pairs (config.json `rope_interleave`, transformers'
default true): the rope rows of q_proj / q_b_proj (per head) and of kv_a_proj_with_mqa (its last
qk_rope_head_dim rows) are de-interleaved on import (even channels first, then odd: rotate-half then gives the same
q.k) and interleaved again on export (written with rope_interleave true). A folder with rope_interleave false is
refused (its rows are in rotate-half order already; not read here). An FP8 folder (block-scaled float8 weights) is
dequantized by checkpoint/fp8_blocks.py before these names are mapped.

Multi-token prediction (model.mtp, num_nextn_predict_layers D): depth k's layer model.layers.{num_hidden_layers + k
- 1}.* (enorm, hnorm, eh_proj, shared_head.norm, a decoder layer's tensors, and copies of the embedding and the
head) maps onto mtp.depths.{k-1}.* (model/mtp_hf.py). A folder holding those layers sets model.mtp's depth (a folder
whose config names D but holds no such layer loads as the main model). transformers' DeepseekV3ForCausalLM builds no
MTP layers (it ignores them): tests/unit/test_mtp_deepseek.py checks the depths against a reference built from
transformers' DeepseekV3DecoderLayer.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from ...errors import CheckpointError
from ..internlm.hf import _common_config, _get, rope_from_config
from ..foreign_keys import mtp_depth
from ..moe import layer_mix_of
from ..mtp_hf import copies_to_hf, is_mtp_layer, mtp_from_hf, mtp_to_hf
from ..spec import AdapterContext, StateDictAdapter

_LAYER = (  # ours (after layers.{i}.) -> HF (after model.layers.{i}.)
    ("attention_norm.weight", "input_layernorm.weight"), ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("attention.wq.weight", "self_attn.q_proj.weight"), ("attention.wq_a.weight", "self_attn.q_a_proj.weight"),
    ("attention.q_a_norm.weight", "self_attn.q_a_layernorm.weight"),
    ("attention.wq_b.weight", "self_attn.q_b_proj.weight"),
    ("attention.wkv_a.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    ("attention.kv_a_norm.weight", "self_attn.kv_a_layernorm.weight"),
    ("attention.wkv_b.weight", "self_attn.kv_b_proj.weight"), ("attention.wo.weight", "self_attn.o_proj.weight"),
    ("feed_forward.w1.weight", "mlp.gate_proj.weight"), ("feed_forward.w2.weight", "mlp.up_proj.weight"),
    ("feed_forward.w3.weight", "mlp.down_proj.weight"), ("feed_forward.gate.weight", "mlp.gate.weight"),
    ("feed_forward.gate.expert_bias", "mlp.gate.e_score_correction_bias"),
    ("feed_forward.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"),
    ("feed_forward.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"),
    ("feed_forward.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"),
)
_TOP = (("tok_embeddings.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"))
_TO_HF, _TO_OURS = dict(_LAYER), {hf: ours for ours, hf in _LAYER}
_EXPERT_W = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_OURS_W = {v: k for k, v in _EXPERT_W.items()}
_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_ROPE_ROWS = ("attention.wq.weight", "attention.wq_b.weight", "attention.wkv_a.weight")


def _rope_order(rope: int, interleave: bool) -> torch.Tensor:
    """The row order taking interleaved rope channels (pairs 2j, 2j+1) to rotate-half's (j, j + rope/2), or back."""
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    return order if interleave else torch.argsort(order)


def _reorder_rope(name: str, w: torch.Tensor, mla: Any, to_ours: bool) -> torch.Tensor:
    """`w` with its rope rows de-interleaved (to_ours) or interleaved (to HF): per head for the queries, the last
    qk_rope_head_dim rows of wkv_a."""
    order = _rope_order(mla.qk_rope_head_dim, to_ours)
    if name == "attention.wkv_a.weight":
        rank = mla.kv_lora_rank
        return torch.cat([w[:rank], w[rank:][order]])
    heads = w.view(-1, mla.qk_head_dim, w.shape[-1])
    nope = mla.qk_nope_head_dim
    return torch.cat([heads[:, :nope], heads[:, nope:][:, order]], dim=1).reshape(w.shape)


def deepseek_to_hf(sd: Mapping[str, torch.Tensor], ctx: AdapterContext) -> dict[str, torch.Tensor]:
    """Our names → DeepseekV3ForCausalLM's (per-expert tensors; rope rows interleaved)."""
    out: dict[str, torch.Tensor] = {}
    top, tie = dict(_TOP), bool(ctx.args.tie_word_embeddings)
    for k, v in sd.items():
        if tie and k == "output.weight":  # HF saves the tied matrix once, as the embedding
            if "tok_embeddings.weight" not in sd:
                out[top["tok_embeddings.weight"]] = v
            out.update(copies_to_hf(k, v, ctx.args))
            continue
        if k in top:
            out[top[k]] = v
            out.update(copies_to_hf(k, v, ctx.args))  # model.mtp: the depths' copies of the embedding and head
            continue
        if k.startswith("mtp."):  # model.mtp's depths: layers num_hidden_layers + k (model/mtp_hf.py)
            out.update(mtp_to_hf(k, v, ctx.args, lambda n, t: deepseek_to_hf({n: t}, ctx)))
            continue
        m = _OURS_LAYER.match(k)
        if m is None:
            raise CheckpointError(f"parameter {k!r} has no DeepseekV3ForCausalLM equivalent")
        layer, rest = m.group(1), m.group(2)
        if rest.startswith("feed_forward.experts.w"):
            for j in range(v.shape[0]):
                out[f"model.layers.{layer}.mlp.experts.{j}.{_EXPERT_W[rest[-2:]]}.weight"] = v[j]
            continue
        if rest not in _TO_HF:
            raise CheckpointError(f"parameter {k!r} has no DeepseekV3ForCausalLM equivalent")
        if rest in _ROPE_ROWS and v.device.type != "meta":
            v = _reorder_rope(rest, v, ctx.args.mla, to_ours=False)
        out[f"model.layers.{layer}.{_TO_HF[rest]}"] = v
    return out


def deepseek_from_hf(hf: Mapping[str, torch.Tensor], ctx: AdapterContext) -> dict[str, torch.Tensor]:
    """DeepseekV3ForCausalLM's names → ours (`_from_hf`); model.mtp's layers (from num_hidden_layers on) through
    model/mtp_hf.py, their block tensors mapped as any layer's."""
    depths = {k: v for k, v in hf.items() if is_mtp_layer(k, ctx.args)}
    out = _from_hf({k: v for k, v in hf.items() if k not in depths}, ctx)
    if depths:
        out.update(mtp_from_hf(depths, ctx.args, lambda block: _from_hf(block, ctx), hf))
    return out


def _from_hf(hf: Mapping[str, torch.Tensor], ctx: AdapterContext) -> dict[str, torch.Tensor]:
    """DeepseekV3ForCausalLM's names (per-expert or fused experts) → ours; rope rows de-interleaved."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    top = {hf_name: ours for ours, hf_name in _TOP}
    for k, v in hf.items():
        if k in top:
            out[top[k]] = v
            continue
        m = _HF_LAYER.match(k)
        rest = m.group(2) if m else ""
        if m and (e := _HF_EXPERT.match(rest)):
            experts.setdefault((m.group(1), _OURS_W[e.group(2)]), {})[int(e.group(1))] = v
        elif m and rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            base = f"layers.{m.group(1)}.feed_forward.experts"
            if rest.endswith("down_proj"):
                out[f"{base}.w2"] = v
            else:
                out[f"{base}.w1"], out[f"{base}.w3"] = v.chunk(2, dim=1)
        elif m and rest in _TO_OURS:
            ours = _TO_OURS[rest]
            out[f"layers.{m.group(1)}.{ours}"] = _reorder_rope(ours, v, ctx.args.mla, True) \
                if ours in _ROPE_ROWS else v
        else:
            raise CheckpointError(f"Hugging Face tensor {k!r} has no counterpart in internlm-core's DEEPSEEK_V3 model")
    for (layer, w), by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise CheckpointError(f"layer {layer}: experts {sorted(by_index)} of {w} are not 0..N-1")
        out[f"layers.{layer}.feed_forward.experts.{w}"] = torch.stack([by_index[j] for j in range(len(by_index))])
    if ctx.args.tie_word_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


# ---- config.json ---------------------------------------------------------------------------------------------

def deepseek_config(cfg: Any, torch_dtype: str = "float32",
                    special_ids: Optional[Mapping[str, Optional[int]]] = None) -> dict:
    """The config.json of a DeepseekV3ForCausalLM equivalent to `cfg` (ModelInputs): dropless sigmoid routing,
    the dense blocks a prefix (first_k_dense_replace), no multi-token prediction layers."""
    m, r = cfg.model, cfg.moe
    if m.moe_type not in ("Dropless", "MegaBlock-Dropless") or r.score_func != "sigmoid" or r.noisy_gate_policy:
        raise CheckpointError(f"model.moe_type={m.moe_type} / moe.score_func={r.score_func} / moe.noisy_gate_policy="
                              f"{r.noisy_gate_policy}: DeepseekV3ForCausalLM routes dropless over sigmoid scores, "
                              "without noise")
    first_k = layer_mix_of(m).dense_prefix(m.num_layers)
    if first_k is None:
        raise CheckpointError(f"model.decoder_sparse_step={m.decoder_sparse_step} / model.mlp_only_layers="
                              f"{m.mlp_only_layers}: DeepseekV3ForCausalLM's dense blocks are the first "
                              "first_k_dense_replace ones only")
    c = _common_config(cfg, torch_dtype, special_ids)
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **c,
            "num_key_value_heads": m.num_attention_heads, "moe_intermediate_size": m.moe_intermediate_size,
            "n_routed_experts": m.num_experts, "num_experts_per_tok": r.top_k, "n_shared_experts": m.num_shared_experts,
            "first_k_dense_replace": first_k, "n_group": r.num_expert_groups, "topk_group": r.top_k_groups,
            "norm_topk_prob": bool(r.norm_topk_prob), "routed_scaling_factor": float(r.routed_scaling_factor),
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "q_lora_rank": m.q_lora_rank,
            "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
            "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim, "rope_interleave": True,
            "attention_bias": False, "attention_dropout": 0.0, "num_nextn_predict_layers": mtp_depth(m.mtp),
            "output_router_logits": False}


def _int_key(c: Mapping, key: str, where: str, default: Any = None) -> Any:
    value = c.get(key, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise CheckpointError(f"{where}: {key}={value!r}: expected an int")
    return value


def config_from_deepseek(c: Mapping, where: str = "config.json") -> dict:
    """Our keys of a DeepseekV3 config.json: `model` keys and DeepSeek's routing (dotted `moe.*`). A key the file
    leaves out is transformers' DeepseekV3Config default (n_group 8, topk_group 4, first_k_dense_replace 3,
    n_shared_experts 1, ...), as the class reads the folder."""
    _refuse_folder_options(c, where)
    heads = int(_get(c, "num_attention_heads", where))
    out = {"num_layers": int(_get(c, "num_hidden_layers", where)), "hidden_size": int(_get(c, "hidden_size", where)),
           "num_attention_heads": heads, "num_kv_attention_heads": heads,
           "vocab_size": int(_get(c, "vocab_size", where)), "intermediate_size": int(_get(c, "intermediate_size", where)),
           "layer_norm_epsilon": float(c.get("rms_norm_eps", 1e-6)),
           "tie_word_embeddings": bool(c.get("tie_word_embeddings", False)), "qkv_bias": False, "qk_norm": False,
           "sliding_window": None, **rope_from_config(c, where)}
    for key, default in (("q_lora_rank", 1536), ("kv_lora_rank", 512), ("qk_nope_head_dim", 128),
                         ("qk_rope_head_dim", 64), ("v_head_dim", 128)):
        out[key] = _int_key(c, key, where, default)  # transformers' DeepseekV3Config defaults
    out.update(num_experts=int(c.get("n_routed_experts", c.get("num_local_experts", 256))),
               top_k=int(c.get("num_experts_per_tok") or 8), moe_type="Dropless",
               moe_intermediate_size=int(_get(c, "moe_intermediate_size", where)),
               num_shared_experts=int(c.get("n_shared_experts", 1) or 0),
               first_k_dense_replace=int(c.get("first_k_dense_replace", 3) or 0), decoder_sparse_step=1,
               mlp_only_layers=[])
    out.update({"moe.score_func": "sigmoid", "moe.noisy_gate_policy": None,
                "moe.norm_topk_prob": bool(c.get("norm_topk_prob", True)),
                "moe.num_expert_groups": int(c.get("n_group", 8) or 1),
                "moe.top_k_groups": int(c.get("topk_group", 4) or 1),
                "moe.routed_scaling_factor": float(c.get("routed_scaling_factor", 2.5))})
    # model.mtp: num_nextn_predict_layers depths when the folder holds their layers (else the main model alone)
    depth = int(c.get("num_nextn_predict_layers") or 0)
    out["mtp"] = depth if depth and _has_layer(Path(where).parent, out["num_layers"]) else None
    return out


def _refuse_folder_options(c: Mapping, where: str) -> None:
    """What DeepseekV3ForCausalLM can hold and internlm-core does not build: bias, non-silu, another scoring,
    grouped keys, rotate-half rope weights."""
    heads = c.get("num_attention_heads")
    checks = ((c.get("attention_bias", False), "attention_bias=true: the latent attention here has no bias"),
              (c.get("hidden_act", "silu") != "silu", f"hidden_act={c.get('hidden_act')!r}: the FFNs are SwiGLU (silu)"),
              (c.get("scoring_func", "sigmoid") != "sigmoid",
               f"scoring_func={c.get('scoring_func')!r}: DeepseekV3ForCausalLM scores experts by a sigmoid"),
              (c.get("topk_method", "noaux_tc") != "noaux_tc",
               f"topk_method={c.get('topk_method')!r}: DeepseekV3ForCausalLM routes group-limited with the selection "
               "bias (noaux_tc)"),
              (c.get("num_key_value_heads") not in (None, heads),
               f"num_key_value_heads={c.get('num_key_value_heads')} != num_attention_heads={heads}: latent attention "
               "expands keys and values for every head"),
              (c.get("moe_layer_freq", 1) != 1,
               f"moe_layer_freq={c.get('moe_layer_freq')}: DeepseekV3ForCausalLM makes every block from "
               "first_k_dense_replace on MoE (DeepSeek-V2's every-n-th layer is not read)"),
              (c.get("rope_interleave", True) is False,
               "rope_interleave=false: rotate-half rope weights are not read (DeepSeek's are interleaved)"))
    for bad, message in checks:
        if bad:
            raise CheckpointError(f"{where}: {message}")


def _has_layer(folder: Path, layer: int) -> bool:
    """Whether the folder's safetensors (their index, else each file's header) hold a model.layers.{layer}.* tensor."""
    prefix = f"model.layers.{layer}."
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return any(k.startswith(prefix) for k in json.loads(index.read_text()).get("weight_map", {}))
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        if any(k.startswith(prefix) for k in header):
            return True
    return False


DEEPSEEK_V3_HF = StateDictAdapter(format="hf", to_foreign=deepseek_to_hf, from_foreign=deepseek_from_hf,
                                  foreign_config=deepseek_config, config_from_foreign=config_from_deepseek,
                                  architectures=("DeepseekV3ForCausalLM", "DeepseekV3ForCausalLM"),
                                  hf_model_types=("deepseek_v3", "kimi_k2"),
                                  description="Hugging Face DeepseekV3ForCausalLM (DeepSeek-V3, Kimi-K2, Moonlight)")
