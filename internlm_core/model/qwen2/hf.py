"""Qwen2's Hugging Face form, `Qwen2ForCausalLM` (Qwen2 and Qwen2.5): Llama's tensor names (model/internlm/hf.py),
bias on q/k/v and none on o, and Qwen's sliding-window keys. Qwen3 (qwen3/) shares the window keys.

Qwen slides the window over the layers from `max_window_layers` on when `use_sliding_window`; internlm-core's
window (model.sliding_window) covers every layer, so a folder is read when no layer slides or all do, and a
windowed model is written with max_window_layers 0.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ...errors import CheckpointError
from ..internlm.hf import (_common_config, _shape_keys, head_dim, llama_from_hf, llama_to_hf, refuse_options,
                           rope_from_config)
from ..spec import StateDictAdapter


def window_config(m: Any) -> dict:
    """Qwen's window keys of `model.sliding_window` (every layer or none)."""
    w = m.sliding_window
    return {"use_sliding_window": bool(w), "sliding_window": w, "max_window_layers": 0 if w else m.num_layers}


def window_from_config(c: Mapping, where: str) -> dict:
    """`{"sliding_window": w}` when every layer slides, None when none does (as transformers' Qwen2Config /
    Qwen3Config: `layer_types`, else layers from `max_window_layers` on slide when `use_sliding_window`, so
    max_window_layers >= num_hidden_layers means no window); a CheckpointError for a mix."""
    window = c.get("sliding_window") if c.get("use_sliding_window") else None
    layers = int(c.get("num_hidden_layers", 0))
    types = c.get("layer_types") or ["sliding_attention" if i >= int(c.get("max_window_layers", 28)) else
                                     "full_attention" for i in range(layers)]
    if not window or all(t == "full_attention" for t in types):
        return {"sliding_window": None}
    if any(t != "sliding_attention" for t in types):
        raise CheckpointError(f"{where}: use_sliding_window with max_window_layers={c.get('max_window_layers')}: "
                              f"the window covers some layers only; internlm-core's model.sliding_window covers "
                              f"every layer (max_window_layers 0) or none")
    return {"sliding_window": int(c["sliding_window"])}


def qwen2_config(cfg: Any, torch_dtype: str = "float32",
                 special_ids: Optional[Mapping[str, Optional[int]]] = None) -> dict:
    """The config.json of a Qwen2ForCausalLM equivalent to `cfg` (ModelInputs)."""
    m = cfg.model
    refuse_options(m, "Qwen2ForCausalLM", allowed=("sliding_window",))
    if not m.qkv_bias:
        raise CheckpointError("model.qkv_bias=False: Qwen2ForCausalLM's q/k/v projections always have a bias")
    c = _common_config(cfg, torch_dtype, special_ids)
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **c, "head_dim": head_dim(m),
            **window_config(m), "attention_dropout": 0.0}


def config_from_qwen2(c: Mapping, where: str = "config.json") -> dict:
    """Our `model` keys of a Qwen2 config.json (q/k/v bias always)."""
    out = _shape_keys(c, where)
    out["qkv_bias"] = True
    out.update(rope_from_config(c, where))
    out.update(window_from_config(c, where))
    return out


QWEN2_HF = StateDictAdapter(format="hf", to_foreign=llama_to_hf, from_foreign=llama_from_hf,
                            foreign_config=qwen2_config, config_from_foreign=config_from_qwen2,
                            architectures=("Qwen2ForCausalLM",), hf_model_types=("qwen2",),
                            description="Hugging Face Qwen2ForCausalLM (Qwen2, Qwen2.5)")
