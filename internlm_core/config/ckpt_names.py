"""The names `ckpt.load_ckpt_info` accepts, kept here once: the config checks them when it is loaded and the
checkpoint package, a layer above, imports them (its registry saves under these contents, its restore has one loader
per foreign type), so the two can never disagree."""

from __future__ import annotations

# load_ckpt_info.content: the parts of a checkpoint, in the order they are loaded ("all" selects every one)
CONTENTS = ("model", "sampler", "optimizer", "scheduler")

# load_ckpt_info.ckpt_type: ours (DCP, loaded by the checkpoint manager), then the foreign formats, which load the
# model only: InternLM's / InternEvo's own folders, Hugging Face folders (Llama, InternLM, InternLM2, ...) and Meta's
# original Llama folders (params.json, consolidated.NN.pth; InternEvo's "llama")
OWN_CKPT_TYPE = "internlm_core"
FOREIGN_CKPT_TYPES = ("internlm", "hf", "hf_llama", "llama")
CKPT_TYPES = (OWN_CKPT_TYPE, *FOREIGN_CKPT_TYPES)

# other spellings of a ckpt_type (InternEvo's, older InternLM's) → the type they mean. InternEvo's internlm_test /
# internlm2_test load its own folders into another tensor/pipeline split, as "internlm" does; "meta": Meta's Llama
CKPT_TYPE_ALIASES = {"internevo": "internlm", "normal": "internlm", "internlm_test": "internlm",
                     "internlm2_test": "internlm", "hf_model": "hf", "hf_internlm": "hf", "hf_internlm2": "hf",
                     "meta": "llama"}
