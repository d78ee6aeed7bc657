"""The MoE load-balance metrics on a hand-computed case: a router that sends each token to the expert of its
largest feature, four tokens, four experts, top-1 with a capacity of one token per expert."""

import torch
import torch.nn as nn

from internlm_core.model.internlm_moe.hooks import moe_step_metrics
from internlm_core.model.moe import MoEArgs, MoEFeedForward


class Blocks(nn.Module):
    """What moe_named_layers looks for: MoE layers under `layers.<index>.feed_forward`."""

    def __init__(self, ffn: nn.Module):
        super().__init__()
        self.layers = nn.ModuleDict({"0": nn.ModuleDict({"feed_forward": ffn})})


def test_load_metrics_hand_computed():
    args = MoEArgs(num_experts=4, top_k=1, ffn_width=8, moe_type="GShard", capacity_factor=1.0, min_capacity=1,
                   drop_tokens=True, use_rts=False, norm_topk_prob=False, aux_loss_coeff=0.01)
    ffn = MoEFeedForward(4, args)
    with torch.no_grad():
        ffn.gate.weight.copy_(10 * torch.eye(4))  # logit j = 10 x feature j: token -> argmax of its features
    # three tokens for expert 0, one for expert 1, none for experts 2 and 3
    x = torch.tensor([[[1.0, 0, 0, 0], [0.9, 0.1, 0, 0], [0.8, 0, 0.1, 0], [0, 1.0, 0, 0]]])
    ffn.train()
    ffn(x)
    m = moe_step_metrics(Blocks(ffn))
    # loads (3, 1, 0, 0), mean 1: busiest 3x the mean, idlest 0; capacity ceil(4 / 4 * 1.0 * 1) = 1 keeps one of
    # expert 0's three tokens: 2 of the 4 (token, expert) pairs dropped
    assert m["moe/layer0/max_load"] == 3.0 and m["moe/layer0/min_load"] == 0.0
    assert m["moe/layer0/dropped"] == 0.5 and m["moe/dropped"] == 0.5 and m["moe/max_load"] == 3.0
    # GShard's l_aux = E * sum_e (fraction of tokens whose first choice is e) * (mean router probability of e)
    probs = torch.softmax(10 * x[0], dim=-1)
    expected = 4 * float(((torch.tensor([3.0, 1, 0, 0]) / 4) * probs.mean(0)).sum())
    assert abs(m["moe/layer0/aux_loss"] - expected) < 1e-5 and m["moe/aux_loss"] == m["moe/layer0/aux_loss"]
    # z-loss: mean over tokens of logsumexp(logits)^2
    assert abs(m["moe/layer0/z_loss"] - float(torch.logsumexp(10 * x[0], -1).pow(2).mean())) < 1e-4
    assert moe_step_metrics(Blocks(ffn)) == {}  # popped: a step without a forward has no metrics
