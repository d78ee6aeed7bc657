"""model.mtp's depths in Hugging Face folders, DeepSeek-V3's layout, for a family's HF adapter to call.

DeepSeek-V3 folders store depth k (1..D, num_nextn_predict_layers = D) as decoder layer num_hidden_layers + k - 1:

    mtp.depths.{k-1}.enorm / hnorm / eh_proj   model.layers.{L+k-1}.enorm / hnorm / eh_proj
    mtp.depths.{k-1}.norm                      model.layers.{L+k-1}.shared_head.norm
    mtp.depths.{k-1}.block.<block tensor>      model.layers.{L+k-1}.<the same tensor of a decoder layer>
    tok_embeddings (shared)                    model.layers.{L+k-1}.embed_tokens (a copy beside model.embed_tokens)
    output (shared)                            model.layers.{L+k-1}.shared_head.head (a copy beside lm_head)

Our depths share the embedding and the output layer: on export both copies are written (as DeepSeek publishes
them); on import each copy is read and must equal the main tensor (CheckpointError naming it otherwise), so that
no tensor of the folder goes unread. transformers' DeepseekV3ForCausalLM builds no MTP layers (it ignores them),
so these tensors have no transformers reference: tests/unit/test_mtp.py checks the depths against a hand-written
DeepSeek MTP forward.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

import torch

from ..errors import CheckpointError

_OURS = re.compile(r"^mtp\.depths\.(\d+)\.(.+)$")
_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "norm.weight": "shared_head.norm.weight"}
_OWN_BACK = {hf: ours for ours, hf in _OWN.items()}
# our shared tensors -> the name of their copy inside each depth's layer
COPIES = {"tok_embeddings.weight": "embed_tokens.weight", "output.weight": "shared_head.head.weight"}


def hf_layer(args: Any, depth: int) -> int:
    """The decoder layer number of depth index `depth` (0-based): num_layers + depth."""
    return int(args.num_layers) + depth


def mtp_to_hf(name: str, tensor: torch.Tensor, args: Any,
              layer_to_hf: Callable[[str, torch.Tensor], Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """HF names of one of our `mtp.depths.*` tensors; `layer_to_hf(our layer name, tensor)` maps a block tensor
    named `layers.{n}.<rest>` the family's way (expert splitting, row orders)."""
    m = _OURS.match(name)
    if m is None:
        raise CheckpointError(f"parameter {name!r} is no multi-token prediction tensor")
    layer, rest = hf_layer(args, int(m.group(1))), m.group(2)
    if rest in _OWN:
        return {f"model.layers.{layer}.{_OWN[rest]}": tensor}
    if rest.startswith("block."):
        return dict(layer_to_hf(f"layers.{layer}.{rest[len('block.'):]}", tensor))
    raise CheckpointError(f"parameter {name!r} has no DeepSeek multi-token prediction equivalent")


def copies_to_hf(name: str, tensor: torch.Tensor, args: Any) -> dict[str, torch.Tensor]:
    """The copies of a shared tensor (`tok_embeddings.weight`, `output.weight`) in every depth's layer; {} for
    any other name or without depths."""
    if name not in COPIES:
        return {}
    copy = tensor if tensor.device.type == "meta" else tensor.clone()  # safetensors refuses tensors sharing memory
    return {f"model.layers.{hf_layer(args, k)}.{COPIES[name]}": copy for k in range(_depth(args))}


def is_mtp_layer(hf_name: str, args: Any) -> bool:
    """Whether an HF tensor name lies in one of the depths' layers (layer number >= num_layers)."""
    m = re.match(r"^model\.layers\.(\d+)\.", hf_name)
    return m is not None and int(args.num_layers) <= int(m.group(1)) < int(args.num_layers) + _depth(args)


def mtp_from_hf(hf: Mapping[str, torch.Tensor], args: Any,
                layer_from_hf: Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]],
                main: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names of the depths' HF tensors (`is_mtp_layer` ones): their own tensors, the block's through
    `layer_from_hf` (the family's mapping of `model.layers.{n}.*` to `layers.{n}.*`), and each copy of the
    embedding / output head checked against the main tensor in `main` (the HF names model.embed_tokens.weight,
    lm_head.weight), when `main` holds it; a copy that differs is refused (ours share one tensor)."""
    out: dict[str, torch.Tensor] = {}
    block: dict[str, torch.Tensor] = {}
    for k, v in hf.items():
        m = re.match(r"^model\.layers\.(\d+)\.(.+)$", k)
        depth, rest = int(m.group(1)) - int(args.num_layers), m.group(2)
        if rest in _OWN_BACK:
            out[f"mtp.depths.{depth}.{_OWN_BACK[rest]}"] = v
        elif rest in COPIES.values():
            main_name = "model.embed_tokens.weight" if rest == "embed_tokens.weight" else "lm_head.weight"
            if main_name in main and not torch.equal(main[main_name].to(v.dtype), v):
                raise CheckpointError(f"{k} differs from {main_name}: internlm-core's multi-token prediction "
                                      f"shares the main model's tensor")
        else:
            block[k] = v
    for ours, v in layer_from_hf(block).items():
        m = re.match(r"^layers\.(\d+)\.(.+)$", ours)
        out[f"mtp.depths.{int(m.group(1)) - int(args.num_layers)}.block.{m.group(2)}"] = v
    return out


def _depth(args: Any) -> int:
    return int(args.mtp_depth)  # ModelArgs.mtp_depth (0: no depths)
