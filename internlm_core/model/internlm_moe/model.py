"""The InternLM transformer with a mixture-of-experts FFN in its blocks (INTERNLM_MoE, MIXTRAL, QWEN3_MoE).

Everything but the FFN is the dense module's (internlm/model.py): attention, norms, rotary, embedding and output
keep their names, so the dense adapters and plans apply to them unchanged. Block i's FFN is a `MoEFeedForward`
(model/moe/): a router over `num_experts` SwiGLU experts, top-k routing, capacity or dropless dispatch, and the
auxiliary losses, which reach the gradient inside the layer (the model's contract stays logits only). The blocks
`layer_mix` makes dense (model/moe/mix.py: first_k_dense_replace, decoder_sparse_step, mlp_only_layers) keep the
dense SwiGLU of width `ffn_width` (the config's intermediate_size) under the dense names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from ..args import ModelArgs
from ..internlm.model import Transformer
from ..moe import LayerMix, MoEArgs, MoEFeedForward


@dataclass
class MoEModelArgs(ModelArgs):
    """The dense args plus the experts' (`moe`) and which blocks have them (`layer_mix`)."""

    moe: Optional[MoEArgs] = None
    layer_mix: LayerMix = LayerMix()


class MoETransformer(Transformer):
    """Transformer whose blocks' FFNs are MoEFeedForward layers (the dense SwiGLU where `layer_mix` says so)."""

    def make_feed_forward(self, a: ModelArgs, layer: int) -> Optional[nn.Module]:
        """Block `layer`'s MoE layer, or None (the dense FFN) for a block the args' LayerMix makes dense."""
        if not a.layer_mix.is_moe(layer):
            return None
        return MoEFeedForward(a.hidden_size, a.moe, init_std=a.init_std)

    def init_weights(self, seed: int = 0, buffer_device: Optional[torch.device] = None) -> None:
        """The dense initialization of every parameter (the router and experts are N(0, init_std) matrices), and
        the MoE layers' buffers (the aux-loss-free expert bias starts at 0; a meta build leaves it unset)."""
        super().init_weights(seed, buffer_device)
        for module in self.modules():
            if isinstance(module, MoEFeedForward):
                module.reset_buffers()
