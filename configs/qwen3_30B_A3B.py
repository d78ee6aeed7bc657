# Qwen3-30B-A3B's shape (Qwen/Qwen3-30B-A3B config.json): 48 layers, hidden 2048, 32 query heads and 4 key/value
# heads of 128 channels, q/k norm, no bias, 128 experts of SwiGLU width 768 in every layer, top-8 dropless softmax
# routing with the top-8 weights renormalized (norm_topk_prob), no shared experts, 151,936-token vocabulary
# (untied), rope base 1e6. HF class Qwen3MoeForCausalLM. 30,532,122,624 parameters; 3.35 B active per token (2.73 B without embedding and output).
JOB_NAME = 'qwen3_30B_A3B_train'
SEQ_LEN = 4096
MICRO_NUM = 4
LR = 3e-4

ckpt = dict(
    enable_save_ckpt=False,  # set True to save checkpoints
    save_ckpt_folder="local:llm_ckpts",
    # import the published weights: load_ckpt_info=dict(path=HF_FOLDER, content=("model",), ckpt_type="hf"),
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

loss = dict(label_smoothing=0, moe_loss_coeff=0.001)  # Qwen3-MoE's router_aux_loss_coef

adam = dict(lr=LR, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.1)
lr_scheduler = dict(warmup_ratio=0.01, eta_min=LR / 10)
hybrid_zero_optimizer = dict(clip_grad_norm=1.0)

moe = dict(top_k=8, norm_topk_prob=True, score_func="softmax")

model_type = "QWEN3_MoE"
model = dict(
    num_layers=48,
    hidden_size=2048,
    num_attention_heads=32,
    num_kv_attention_heads=4,
    head_dim=128,
    qk_norm=True,
    intermediate_size=6144,  # Qwen's dense width (unused: every layer is sparse)
    moe_intermediate_size=768,
    num_experts=128,
    moe_type="Dropless",
    vocab_size=151936,
    rope_base=1000000.0,
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
