# DeepSeek-V3's shape (deepseek-ai/DeepSeek-V3 config.json; -V3-Base and -R1 share it): 61 layers, hidden 7168,
# multi-head latent attention with 128 heads (q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128,
# qk_rope_head_dim 64, v_head_dim 128), YaRN rope (factor 40, original 4096, mscale = mscale_all_dim = 1: softmax
# scale x 1.874), the first 3 layers dense (intermediate_size 18432), then 256 routed experts of width 2048 plus 1
# shared expert, top-8 over sigmoid scores limited to 4 of 8 expert groups, the aux-loss-free selection bias,
# norm_topk_prob, routed_scaling_factor 2.5; 129,280-token vocabulary (untied), rms_norm_eps 1e-6.
# HF class DeepseekV3ForCausalLM (its FP8 block-scaled folder loads dequantized: ckpt_type "hf").
# `train.py --config configs/deepseek_v3_671B.py --dry-run`: 671,026,404,352 parameters (671.0 B); 37.55 B
# activated per token (DeepSeek's "671B total / 37B activated"). The multi-token prediction module (num_nextn_
# predict_layers 1, another 14 B in the published folder) is not counted.
JOB_NAME = 'deepseek_v3_671B_train'
SEQ_LEN = 4096
MICRO_NUM = 4
LR = 2.2e-4

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

loss = dict(label_smoothing=0, moe_loss_coeff=0.0001)  # DeepSeek-V3's sequence-wise balance alpha, as a batch-wise l_aux

adam = dict(lr=LR, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.1)
lr_scheduler = dict(warmup_ratio=0.01, eta_min=LR / 10)
hybrid_zero_optimizer = dict(clip_grad_norm=1.0)

# DeepSeek-V3's routing: sigmoid scores, group-limited top-8 (4 of 8 groups), renormalized, x 2.5; the selection
# bias moved by 0.001 per step toward balance (their bias update speed gamma)
moe = dict(top_k=8, score_func="sigmoid", norm_topk_prob=True, num_expert_groups=8, top_k_groups=4,
           routed_scaling_factor=2.5, expert_bias_update_rate=0.001)

model_type = "DEEPSEEK_V3"
model = dict(
    num_layers=61,
    hidden_size=7168,
    num_attention_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    intermediate_size=18432,  # the dense layers' width
    first_k_dense_replace=3,
    moe_intermediate_size=2048,
    num_experts=256,
    num_shared_experts=1,
    moe_type="Dropless",
    vocab_size=129280,
    rope_base=10000.0,
    rope_scaling=dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32,
                      beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
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
