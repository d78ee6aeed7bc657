"""Llama's foreign forms: Hugging Face `LlamaForCausalLM` (the InternLM transformer's Llama names and config.json,
model/internlm/hf.py, shared by every family built on that module) and Meta's original checkpoint folders
(meta.py: params.json, consolidated.NN.pth)."""

from __future__ import annotations

from ..internlm.hf import LLAMA_HF
from .meta import META_LLAMA

ADAPTERS = {"hf": LLAMA_HF, "hf_llama": LLAMA_HF, "llama": META_LLAMA}
