"""Build a model from the config: the registry by `model_type`."""

from __future__ import annotations

from typing import Callable

import torch

from ..config import Config, ffn_width
from .attention import select_attention_backend
from .transformer import ModelArgs, Transformer

# model_type → the class that implements it; every family here shares one readable Transformer.
MODEL_REGISTRY: dict[str, Callable[[ModelArgs], torch.nn.Module]] = {
    "INTERNLM": Transformer,
    "INTERNLM2": Transformer,
    "LLAMA": Transformer,
}


def model_args_from_config(cfg: Config, device_type: str = "cpu", quiet: bool = False) -> ModelArgs:
    """Resolve the model section (and the attention backend for this device) into ModelArgs."""
    m = cfg.model
    return ModelArgs(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
        num_heads=m.num_attention_heads, num_kv_heads=m.num_kv_attention_heads, ffn_width=ffn_width(m),
        max_seqlen=cfg.data.seq_len, qkv_bias=bool(m.qkv_bias), norm_eps=m.layer_norm_epsilon,
        rope_base=m.rope_base, tie_word_embeddings=m.tie_word_embeddings, init_std=m.init_std,
        embed_grad_scale=m.embed_grad_scale, apply_post_layer_norm=m.apply_post_layer_norm,
        use_fp32_norm=m.use_fp32_norm,
        attn_backend=select_attention_backend(m.attn_backend, m.use_flash_attn, device_type, quiet=quiet),
    )


def build_model(cfg: Config, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The model of `cfg.model_type`, initialized on `device` ("meta" builds without allocating)."""
    device = torch.device(device)
    args = model_args_from_config(cfg, "cuda" if device.type == "cuda" else device.type)
    with torch.device(device):
        model = MODEL_REGISTRY[cfg.model_type](args)
    return model


def apply_activation_checkpointing(model: torch.nn.Module, setting: bool | float) -> int:
    """Recompute the first round(fraction * L) blocks in backward (InternLM's `model.checkpoint`); returns how many."""
    layers = list(getattr(model, "layers").values())
    frac = 1.0 if setting is True else 0.0 if setting is False else float(setting)
    n = round(frac * len(layers))
    for i, layer in enumerate(layers):
        layer.use_checkpoint = i < n
    return n
