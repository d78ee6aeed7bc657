"""Qwen3's Hugging Face form, `Qwen3ForCausalLM`: Llama's tensor names plus the q/k norms
(`self_attn.q_norm` / `k_norm`, mapped in model/internlm/hf.py), `attention_bias` on q/k/v/o (off in every
published Qwen3), head_dim 128 whatever the width, and Qwen's window keys (qwen2/hf.py)."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ...errors import CheckpointError
from ..internlm.hf import (_common_config, _shape_keys, head_dim, llama_from_hf, llama_to_hf, refuse_options,
                           rope_from_config)
from ..qwen2.hf import window_config, window_from_config
from ..spec import StateDictAdapter


def qwen3_config(cfg: Any, torch_dtype: str = "float32",
                 special_ids: Optional[Mapping[str, Optional[int]]] = None) -> dict:
    """The config.json of a Qwen3ForCausalLM equivalent to `cfg` (ModelInputs)."""
    m = cfg.model
    refuse_options(m, "Qwen3ForCausalLM", allowed=("qk_norm", "sliding_window", "window_layers"))
    if not m.qk_norm:
        raise CheckpointError("model.qk_norm=False: Qwen3ForCausalLM always normalizes q and k")
    c = _common_config(cfg, torch_dtype, special_ids)
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **c, "head_dim": head_dim(m),
            "attention_bias": bool(m.qkv_bias), **window_config(m), "attention_dropout": 0.0}


def config_from_qwen3(c: Mapping, where: str = "config.json") -> dict:
    """Our `model` keys of a Qwen3 config.json (q/k norm always; head_dim kept when it is not width / heads)."""
    out = _shape_keys({"head_dim": 128, **c}, where)  # transformers' Qwen3Config default head_dim
    out.update(qkv_bias=bool(c.get("attention_bias", False)), qk_norm=True)
    out.update(rope_from_config(c, where))
    out.update(window_from_config(c, where))
    return out


QWEN3_HF = StateDictAdapter(format="hf", to_foreign=llama_to_hf, from_foreign=llama_from_hf,
                            foreign_config=qwen3_config, config_from_foreign=config_from_qwen3,
                            architectures=("Qwen3ForCausalLM",), hf_model_types=("qwen3",),
                            description="Hugging Face Qwen3ForCausalLM")
