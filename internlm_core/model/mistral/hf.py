"""Mistral's Hugging Face form, `MistralForCausalLM`: Llama's tensor names, no bias, and `sliding_window`
(model.sliding_window: every layer's window, None for none, as Mistral 7B v0.2 and later)."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ...errors import CheckpointError
from ..internlm.hf import (_common_config, _shape_keys, head_dim, llama_from_hf, llama_to_hf, refuse_options,
                           rope_from_config)
from ..spec import StateDictAdapter


def mistral_config(cfg: Any, torch_dtype: str = "float32",
                   special_ids: Optional[Mapping[str, Optional[int]]] = None) -> dict:
    """The config.json of a MistralForCausalLM equivalent to `cfg` (ModelInputs)."""
    m = cfg.model
    refuse_options(m, "MistralForCausalLM", allowed=("sliding_window",))
    if m.qkv_bias:
        raise CheckpointError("model.qkv_bias=True: MistralForCausalLM's attention has no bias")
    c = _common_config(cfg, torch_dtype, special_ids)
    return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", **c, "head_dim": head_dim(m),
            "sliding_window": m.sliding_window, "attention_dropout": 0.0}


def config_from_mistral(c: Mapping, where: str = "config.json") -> dict:
    """Our `model` keys of a Mistral config.json (without a `sliding_window` key: transformers' default 4096)."""
    if c.get("layer_types"):
        raise CheckpointError(f"{where}: layer_types (alternating attention, Ministral's): internlm-core's "
                              "sliding window covers every layer")
    out = _shape_keys(c, where)
    out.update(qkv_bias=False, **rope_from_config(c, where))
    window = c.get("sliding_window", 4096)  # transformers' MistralConfig default (Mistral 7B v0.1's); null: none
    if window:
        out["sliding_window"] = int(window)
    return out


MISTRAL_HF = StateDictAdapter(format="hf", to_foreign=llama_to_hf, from_foreign=llama_from_hf,
                              foreign_config=mistral_config, config_from_foreign=config_from_mistral,
                              architectures=("MistralForCausalLM",), hf_model_types=("mistral",),
                              description="Hugging Face MistralForCausalLM")
