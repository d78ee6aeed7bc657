# Moonlight-16B-A3B's shape (moonshotai/Moonlight-16B-A3B config.json, DeepseekV3ForCausalLM): 27 layers, hidden
# 2048, multi-head latent attention with 16 heads and a full-rank query projection (q_lora_rank null), kv_lora_rank
# 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, rope base 50000 without scaling; the first layer
# dense (intermediate_size 11264), then 64 routed experts of width 1408 plus 2 shared experts, top-6 over sigmoid
# scores (one expert group), the selection bias, norm_topk_prob, routed_scaling_factor 2.446; 163,840-token
# vocabulary (untied), 8K context.
# `train.py --config configs/moonlight_16B_A3B.py --dry-run`: 15,960,108,544 parameters (16.0 B); 2.91 B activated
# per token (Moonshot's "16B / 3B"; their 15.29 B / 2.24 B leave out the embedding and the output layer, 0.67 B).
# Trained with Muon (Moonlight's update scale 0.2 * sqrt(max(rows, columns)): optimizer.muon_rms_scale's default).
JOB_NAME = 'moonlight_16B_A3B_train'
SEQ_LEN = 8192
MICRO_NUM = 4
LR = 4.2e-4

ckpt = dict(
    enable_save_ckpt=False,  # set True to save checkpoints
    save_ckpt_folder="local:llm_ckpts",
    # import the published weights: load_ckpt_info=dict(path=HF_FOLDER, content=("model",), ckpt_type="hf")
    auto_resume=True,
    checkpoint_every=50,
)

data = dict(
    seq_len=SEQ_LEN,
    micro_num=MICRO_NUM,  # micro-batches per step (gradient accumulation)
    micro_bsz=1,  # sequences packed into one micro-batch row
    valid_every=0,
    total_steps=50000,
    min_length=50,
    train_folder=None,  # e.g. "/path/to/tokenized/train/"
)

loss = dict(label_smoothing=0, moe_loss_coeff=0.0001)  # as DeepSeek-V3's sequence-wise balance alpha, here a batch-wise l_aux

adam = dict(lr=LR, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.1)
lr_scheduler = dict(warmup_ratio=0.01, eta_min=LR / 10)
hybrid_zero_optimizer = dict(clip_grad_norm=1.0)

optimizer = dict(name="muon")

# Moonlight's routing: sigmoid scores, top-6 of 64 (no group limit), renormalized, x 2.446, the selection bias
moe = dict(top_k=6, score_func="sigmoid", norm_topk_prob=True, num_expert_groups=1, top_k_groups=1,
           routed_scaling_factor=2.446, expert_bias_update_rate=0.001)

model_type = "DEEPSEEK_V3"
model = dict(
    num_layers=27,
    hidden_size=2048,
    num_attention_heads=16,
    q_lora_rank=None,  # a full-rank query projection
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    intermediate_size=11264,  # the dense layer's width
    first_k_dense_replace=1,
    moe_intermediate_size=1408,
    num_experts=64,
    num_shared_experts=2,
    moe_type="Dropless",
    vocab_size=163840,
    rope_base=50000.0,
    layer_norm_epsilon=1e-6,
    checkpoint=True,  # activation checkpointing
    dtype="torch.bfloat16",
    use_flash_attn=True,
)

parallel = dict(
    zero1=-1,
    tensor=1,
    pipeline=1,
    expert=-1,  # expert parallel over all of the sharded data-parallel ranks (at most one per expert)
)
