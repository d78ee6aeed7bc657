"""Mixture-of-experts families on the InternLM transformer:

INTERNLM_MoE  InternEvo's MoE model (InternLM v1 block: bias on q/k/v/o, multi-head attention) with
              `model.num_experts`, `model.moe_type`, the `moe` section and `parallel.expert` as InternEvo names them.
MIXTRAL       the Llama block (grouped-query attention, no bias) with MoE FFNs: Mixtral's shape.
"""

from __future__ import annotations

from ..spec import ModelSpec, register_model
from ..internlm.rules import bias_default
from .counts import COUNTS, flops_per_token
from .hf import MIXTRAL_HF
from .hooks import MOE_HOOKS
from .internlm_ckpt import INTERNEVO_MOE_CKPT
from .model import MoEModelArgs, MoETransformer
from .parallelize import MOE_PLAN
from .rules import build_moe_args, moe_args, validate_moe

INTERNLM_MOE = register_model(ModelSpec(
    name="INTERNLM_MoE", aliases=("INTERNLM_MOE",),
    description="InternEvo's MoE: the InternLM v1 block with a mixture-of-experts FFN",
    module=MoETransformer, build_args=build_moe_args, plan=MOE_PLAN,
    fill_defaults=bias_default(True),
    validate=lambda inputs: validate_moe(inputs, grouped_query=False),
    sizes={"7B_MoE4": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, vocab_size=103168,
                           mlp_ratio=4 / 3, num_experts=4)},
    counts=COUNTS, flops_per_token=flops_per_token, adapters={"hf": MIXTRAL_HF, "internlm": INTERNEVO_MOE_CKPT},
    hooks=MOE_HOOKS,
))

MIXTRAL = register_model(ModelSpec(
    name="MIXTRAL", aliases=("MIXTRAL_MOE",),
    description="Mixtral: the Llama block (grouped-query attention, no bias) with a mixture-of-experts FFN",
    module=MoETransformer, build_args=build_moe_args, plan=MOE_PLAN,
    fill_defaults=bias_default(False),
    validate=lambda inputs: validate_moe(inputs, grouped_query=True),
    sizes={"8x7B": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_kv_attention_heads=8,
                        vocab_size=32000, intermediate_size=14336, num_experts=8, rope_base=1e6)},
    counts=COUNTS, flops_per_token=flops_per_token, adapters={"hf": MIXTRAL_HF}, hooks=MOE_HOOKS,
))

__all__ = ["INTERNLM_MOE", "MIXTRAL", "MoEModelArgs", "MoETransformer", "moe_args"]
