# Llama-3.1-8B's shape (meta-llama/Llama-3.1-8B config.json): 32 layers, hidden 4096, 32 query heads, 8 key/value
# heads, SwiGLU width 14336, 128,256-token vocabulary (untied output), rope base 500000 with Llama 3.1's "llama3"
# frequency scaling (factor 8 over the original 8192 positions). Import its HF folder with ckpt_type "hf"; export with
# tools/convert2hf.py (LlamaForCausalLM, rope_scaling kept). 8,030,261,248 parameters.
JOB_NAME = 'llama3_8B_train'
SEQ_LEN = 8192
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

model_type = "LLAMA3"
model = dict(
    num_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_kv_attention_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
    rope_base=500000.0,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
    layer_norm_epsilon=1e-5,
    tie_word_embeddings=False,
    checkpoint=True,  # activation checkpointing
    dtype="torch.bfloat16",
    use_flash_attn=True,
)

parallel = dict(
    zero1=-1,  # FSDP over every data-parallel rank
    tensor=1,
    pipeline=1,
)
