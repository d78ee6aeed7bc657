"""The InternLM transformer with a mixture-of-experts FFN in every block (INTERNLM_MoE, MIXTRAL).

Everything but the FFN is the dense module's (internlm/model.py): attention, norms, rotary, embedding and output
keep their names, so the dense adapters and plans apply to them unchanged. Block i's FFN is a `MoEFeedForward`
(model/moe/): a router over `num_experts` SwiGLU experts, top-k routing, capacity or dropless dispatch, and the
auxiliary losses, which reach the gradient inside the layer (the model's contract stays logits only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from ..args import ModelArgs
from ..internlm.model import Transformer
from ..moe import MoEArgs, MoEFeedForward


@dataclass
class MoEModelArgs(ModelArgs):
    """The dense args plus the experts' (`moe`)."""

    moe: Optional[MoEArgs] = None


class MoETransformer(Transformer):
    """Transformer whose blocks' FFNs are MoEFeedForward layers."""

    def make_feed_forward(self, a: ModelArgs, layer: int) -> Optional[nn.Module]:
        return MoEFeedForward(a.hidden_size, a.moe, init_std=a.init_std)

    def init_weights(self, seed: int = 0, buffer_device: Optional[torch.device] = None) -> None:
        """The dense initialization of every parameter (the router and experts are N(0, init_std) matrices), and
        the MoE layers' buffers (the aux-loss-free expert bias starts at 0; a meta build leaves it unset)."""
        super().init_weights(seed, buffer_device)
        for module in self.modules():
            if isinstance(module, MoEFeedForward):
                module.reset_buffers()
