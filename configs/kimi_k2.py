# Kimi-K2's shape (moonshotai/Kimi-K2-Base and -Instruct config.json, DeepseekV3ForCausalLM's architecture, model_type
# kimi_k2): 61 layers, hidden 7168, multi-head latent attention with 64 heads (q_lora_rank 1536, kv_lora_rank 512,
# qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128), YaRN rope (base 50000, factor 32, original 4096,
# beta_fast = beta_slow = 1, mscale = mscale_all_dim = 1), the first layer dense (intermediate_size 18432), then 384
# routed experts of width 2048 plus 1 shared expert, top-8 over sigmoid scores (one expert group: no group limit),
# the selection bias, norm_topk_prob, routed_scaling_factor 2.827; 163,840-token vocabulary (untied), no MTP layers.
# `train.py --config configs/kimi_k2.py --dry-run`: 1,026,408,209,408 parameters (1.03 T); 32.86 B activated per
# token (Moonshot's "1T total / 32B activated"; the 1.04 T rounds the same count up).
# Trained with MuonClip (Muon + qk-clip): optimizer.name="muon" here; qk-clip is not set by this config.
JOB_NAME = 'kimi_k2_train'
SEQ_LEN = 4096
MICRO_NUM = 4
LR = 2e-4

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

# Kimi-K2's routing: sigmoid scores, top-8 of 384 (no group limit), renormalized, x 2.827, the selection bias
moe = dict(top_k=8, score_func="sigmoid", norm_topk_prob=True, num_expert_groups=1, top_k_groups=1,
           routed_scaling_factor=2.827, expert_bias_update_rate=0.001)

model_type = "DEEPSEEK_V3"
model = dict(
    num_layers=61,
    hidden_size=7168,
    num_attention_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    intermediate_size=18432,  # the dense layers' width
    first_k_dense_replace=1,
    moe_intermediate_size=2048,
    num_experts=384,
    num_shared_experts=1,
    moe_type="Dropless",
    vocab_size=163840,
    rope_base=50000.0,
    rope_scaling=dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0,
                      beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
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
