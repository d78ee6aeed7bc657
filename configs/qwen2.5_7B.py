# Qwen2.5-7B's shape (Qwen/Qwen2.5-7B config.json): 28 layers, hidden 3584, 28 query heads, 4 key/value heads,
# bias on q, k and v (none on o), SwiGLU width 18944, 152,064-token vocabulary (untied), rope base 1e6, RMSNorm eps
# 1e-6. HF class Qwen2ForCausalLM (import ckpt_type "hf", export tools/convert2hf.py). 7,615,616,512 parameters.
JOB_NAME = 'qwen2.5_7B_train'
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

loss = dict(label_smoothing=0)

adam = dict(lr=LR, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.1)
lr_scheduler = dict(warmup_ratio=0.01, eta_min=LR / 10)
hybrid_zero_optimizer = dict(clip_grad_norm=1.0)

model_type = "QWEN2"
model = dict(
    num_layers=28,
    hidden_size=3584,
    num_attention_heads=28,
    num_kv_attention_heads=4,
    intermediate_size=18944,
    vocab_size=152064,
    qkv_bias=True,
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
)
