# Qwen3-8B's shape (Qwen/Qwen3-8B config.json): 36 layers, hidden 4096, 32 query heads and 8 key/value heads of 128
# channels, RMSNorm on q and k over each head (qk_norm), no bias, SwiGLU width 12288, 151,936-token vocabulary
# (untied), rope base 1e6, RMSNorm eps 1e-6. HF class Qwen3ForCausalLM. 8,190,735,360 parameters.
JOB_NAME = 'qwen3_8B_train'
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

model_type = "QWEN3"
model = dict(
    num_layers=36,
    hidden_size=4096,
    num_attention_heads=32,
    num_kv_attention_heads=8,
    head_dim=128,
    qk_norm=True,
    intermediate_size=12288,
    vocab_size=151936,
    rope_base=1000000.0,
    layer_norm_epsilon=1e-6,
    # Memory policies, by `tools/estimate.py --config configs/qwen3_8B.py --gpus 8` (peak per GPU, 4,096 tokens per
    # micro-batch): no recomputation 42.5 GiB; "selective" 33.2 GiB (each layer keeps its matmul and attention
    # outputs, the elementwise ops are recomputed: no matmul runs twice); checkpoint=0.5 31.9 GiB and True 24.5 GiB
    # (+15% / +31% FLOPs per token). Selective: use True on GPUs under 40 GiB.
    checkpoint="selective",
    # the fused head (model.fused_head_loss) drops the 1.2 GiB of bf16 logits, but at 4,096 tokens its two fp32
    # chunks (1 GiB) and the head's weight gradient at that moment raise the estimated peak: 34.3 GiB against 33.2.
    # "auto" (the estimator's choice) leaves it unfused here
    fused_head_loss="auto",
    # activation offload under "selective" moves only the layers' inputs (1.3 GiB to the host) for 32.1 GiB; without
    # recomputation it reaches 24.5 GiB but copies 22 GiB per micro-batch each way over PCIe, more than the
    # micro-batch's compute time hides. Off.
    offload_activations=False,
    dtype="torch.bfloat16",
    use_flash_attn=True,
)

parallel = dict(
    zero1=-1,
    tensor=1,
    pipeline=1,
)
