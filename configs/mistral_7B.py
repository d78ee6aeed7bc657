# Mistral-7B-v0.1's shape (mistralai/Mistral-7B-v0.1 config.json): 32 layers, hidden 4096, 32 query heads, 8
# key/value heads, SwiGLU width 14336, 32,000-token vocabulary (untied), rope base 10000, sliding-window attention
# over 4096 tokens (each token sees itself and the 4095 before it in its document; every attention kernel's mask
# holds it). HF class MistralForCausalLM. 7,241,732,096 parameters.
JOB_NAME = 'mistral_7B_train'
SEQ_LEN = 8192  # longer than the window: the window matters
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

model_type = "MISTRAL"
model = dict(
    num_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_kv_attention_heads=8,
    intermediate_size=14336,
    vocab_size=32000,
    rope_base=10000.0,
    sliding_window=4096,
    layer_norm_epsilon=1e-5,
    checkpoint=True,  # activation checkpointing
    dtype="torch.bfloat16",
    use_flash_attn=True,
)

parallel = dict(
    zero1=-1,
    tensor=1,
    pipeline=1,
)
