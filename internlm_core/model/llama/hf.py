"""Llama's Hugging Face form, `LlamaForCausalLM`: the InternLM transformer's Llama names and config.json
(model/internlm/hf.py, shared by every family built on that module), Llama's own HF class."""

from __future__ import annotations

from ..internlm.hf import LLAMA_HF

ADAPTERS = {"hf": LLAMA_HF, "hf_llama": LLAMA_HF}
