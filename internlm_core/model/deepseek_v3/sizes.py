"""DEEPSEEK_V3's published shapes, from the models' config.json (values stated here so that a config can be read
without the Hub): `tools/estimate.py --size`, and configs/deepseek_v3_671B.py, configs/kimi_k2.py,
configs/moonlight_16B_A3B.py. Each is `model` keys plus the DeepSeek routing of the `moe` section (dotted keys,
applied by the configs). Multi-token prediction modules (DeepSeek-V3's num_nextn_predict_layers 1) are not part of
these counts."""

from __future__ import annotations

_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, layer_norm_epsilon=1e-6,
            moe_type="Dropless", qkv_bias=False, tie_word_embeddings=False)
SIZES = {
    # deepseek-ai/DeepSeek-V3 (and -V3-Base, -R1): 671B total, 37B activated (+ the 14B MTP module, not built here)
    "671B": dict(_MLA, vocab_size=129280, hidden_size=7168, num_layers=61, num_attention_heads=128,
                 intermediate_size=18432, moe_intermediate_size=2048, num_experts=256, top_k=8,
                 num_shared_experts=1, first_k_dense_replace=3, q_lora_rank=1536, rope_base=10000.0,
                 rope_scaling=dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096,
                                   beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
    # moonshotai/Kimi-K2-Base / -Instruct: 1.04T total, 32B activated
    "kimi_k2": dict(_MLA, vocab_size=163840, hidden_size=7168, num_layers=61, num_attention_heads=64,
                    intermediate_size=18432, moe_intermediate_size=2048, num_experts=384, top_k=8,
                    num_shared_experts=1, first_k_dense_replace=1, q_lora_rank=1536, rope_base=50000.0,
                    rope_scaling=dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096,
                                      beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
    # moonshotai/Moonlight-16B-A3B: ~16B total (15.3B), ~3B activated (2.24B); full-rank queries, no rope scaling
    "moonlight_16B_A3B": dict(_MLA, vocab_size=163840, hidden_size=2048, num_layers=27, num_attention_heads=16,
                              intermediate_size=11264, moe_intermediate_size=1408, num_experts=64, top_k=6,
                              num_shared_experts=2, first_k_dense_replace=1, q_lora_rank=None, rope_base=50000.0,
                              rope_scaling=None),
}
# the `moe` section of each (group-limited sigmoid routing, renormalized top-k, routed_scaling_factor)
ROUTING = {
    "671B": dict(score_func="sigmoid", norm_topk_prob=True, num_expert_groups=8, top_k_groups=4,
                 routed_scaling_factor=2.5),
    "kimi_k2": dict(score_func="sigmoid", norm_topk_prob=True, num_expert_groups=1, top_k_groups=1,
                    routed_scaling_factor=2.827),
    "moonlight_16B_A3B": dict(score_func="sigmoid", norm_topk_prob=True, num_expert_groups=1, top_k_groups=1,
                              routed_scaling_factor=2.446),
}
