"""Qwen2's Hugging Face form, `Qwen2ForCausalLM` (Qwen2 and Qwen2.5): Llama's tensor names (model/internlm/hf.py),
bias on q/k/v and none on o, and Qwen's sliding-window keys. Qwen3 (qwen3/) shares the window keys.

Qwen slides the window over the layers from `max_window_layers` on when `use_sliding_window` (transformers 5:
over the `layer_types` that say so); internlm-core's model.window_layers names those layers (None: every layer).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ...errors import CheckpointError
from ..internlm.hf import (_common_config, _shape_keys, head_dim, llama_from_hf, llama_to_hf, refuse_options,
                           rope_from_config)
from ..spec import StateDictAdapter


def window_config(m: Any) -> dict:
    """Qwen's window keys of `model.sliding_window` and `model.window_layers`: max_window_layers when the windowed
    layers are the last ones (0: every layer), else also `layer_types`, which transformers 5 reads first."""
    w, layers, n = m.sliding_window, m.window_layers, m.num_layers
    if not w:
        return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": n}
    if layers is None:
        return {"use_sliding_window": True, "sliding_window": w, "max_window_layers": 0}
    slide = set(int(i) for i in layers)
    first = min(slide) if slide else n
    out = {"use_sliding_window": True, "sliding_window": w, "max_window_layers": first}
    if slide != set(range(first, n)):
        out["layer_types"] = ["sliding_attention" if i in slide else "full_attention" for i in range(n)]
    return out


def window_from_config(c: Mapping, where: str) -> dict:
    """`sliding_window` and `window_layers` (the sliding layers, None for every layer) of Qwen's keys, as
    transformers' Qwen2Config / Qwen3Config apply them: `layer_types`, else layers from `max_window_layers` on
    slide when `use_sliding_window` (max_window_layers >= num_hidden_layers: no window; without a sliding_window
    key: the classes' default 4096)."""
    window = c.get("sliding_window", 4096) if c.get("use_sliding_window") else None  # the classes' default
    layers = int(c.get("num_hidden_layers", 0))
    types = c.get("layer_types") or ["sliding_attention" if i >= int(c.get("max_window_layers", 28)) else
                                     "full_attention" for i in range(layers)]
    if not window or all(t == "full_attention" for t in types):
        return {"sliding_window": None, "window_layers": None}
    if len(types) != layers or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise CheckpointError(f"{where}: layer_types {types}: expected {layers} of sliding_attention / "
                              "full_attention")
    some = [i for i, t in enumerate(types) if t == "sliding_attention"]
    return {"sliding_window": int(window), "window_layers": None if len(some) == layers else some}


def qwen2_config(cfg: Any, torch_dtype: str = "float32",
                 special_ids: Optional[Mapping[str, Optional[int]]] = None) -> dict:
    """The config.json of a Qwen2ForCausalLM equivalent to `cfg` (ModelInputs)."""
    m = cfg.model
    refuse_options(m, "Qwen2ForCausalLM", allowed=("sliding_window", "window_layers"))
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
