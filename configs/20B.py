# InternLM-20B's shape (60 layers, hidden 5120, 40 heads, vocabulary 103168; InternLM v1: bias on q/k/v/o),
# in the keys of InternLM's configs/7B_sft.py (commit aaaf4d7).
# Layouts (tools/estimate.py --config configs/20B.py --gpus N --set ..., H100/H200 80 GiB, bf16, seq 4096):
# (the layout without activation recomputation and with the fewest pipeline stages that fits, micro_num 8)
#   64 GPUs:  tensor 4 + sequence parallel, pipeline 1, zero1=-1 (FSDP over dp 16), micro_bsz 2: 30.7 GiB per GPU  <- the `parallel` below
#   256 GPUs: tensor 4 + sequence parallel, pipeline 1, zero1=-1 (FSDP over dp 64), micro_bsz 2: 27.2 GiB per GPU
JOB_NAME = "20b_train"
DO_ALERT = False

SEQ_LEN = 4096
HIDDEN_SIZE = 5120
NUM_ATTENTION_HEAD = 40
MLP_RATIO = 8 / 3
NUM_LAYER = 60
VOCAB_SIZE = 103168

MODEL_ONLY_FOLDER = "local:llm_ckpts/xxxx"
SAVE_CKPT_FOLDER = "local:llm_ckpts"
CHECKPOINT_EVERY = 50

ckpt = dict(
    enable_save_ckpt=False,  # set True to save checkpoints
    save_ckpt_folder=SAVE_CKPT_FOLDER,
    # load_ckpt_info=dict(path=MODEL_ONLY_FOLDER, content=("model",), ckpt_type="internlm_core"),
    auto_resume=True,
    checkpoint_every=CHECKPOINT_EVERY,
    async_upload=True,
    async_upload_tmp_folder="/dev/shm/internlm_tmp_ckpt/",
    oss_snapshot_freq=int(CHECKPOINT_EVERY / 2),
)

TRAIN_FOLDER = None  # e.g. "/path/to/tokenized/train/"
VALID_FOLDER = None  # e.g. "/path/to/tokenized/valid/"
data = dict(
    seq_len=SEQ_LEN,
    micro_num=8,  # micro-batches per step (gradient accumulation)
    micro_bsz=2,  # sequences packed into one micro-batch row
    valid_micro_num=4,
    valid_every=50,
    pack_sample_into_one=False,
    total_steps=50000,
    skip_batches="",
    rampup_batch_size="",
    min_length=50,
    train_folder=TRAIN_FOLDER,
    valid_folder=VALID_FOLDER,
    empty_cache_and_diag_interval=10,
    diag_outlier_ratio=1.1,
)

grad_scaler = dict(
    fp16=dict(initial_scale=2**16, min_scale=1, growth_interval=1000),
    growth_factor=2,
    backoff_factor=0.5,
    max_scale=2**24,
    hysteresis=2,
)

hybrid_zero_optimizer = dict(
    overlap_sync_grad=True,
    overlap_sync_param=True,
    reduce_bucket_size=512 * 1024 * 1024,
    clip_grad_norm=1.0,
)

loss = dict(label_smoothing=0)

adam = dict(
    lr=1e-4,
    adam_beta1=0.9,
    adam_beta2=0.95,
    adam_beta2_c=0,
    adam_eps=1e-8,
    weight_decay=0.01,
)

lr_scheduler = dict(
    # total_steps defaults to data.total_steps (so that `--set data.total_steps=N` shortens the schedule too)
    init_steps=0,
    warmup_ratio=0.01,
    eta_min=1e-5,
    last_epoch=-1,
)

beta2_scheduler = dict(
    init_beta2=adam["adam_beta2"],
    c=adam["adam_beta2_c"],
    cur_iter=-1,
)

model_type = "INTERNLM"
use_fp32_norm = False
model = dict(
    checkpoint=False,  # activation checkpointing: True, False, or a fraction of the layers
    num_attention_heads=NUM_ATTENTION_HEAD,
    embed_split_hidden=True,
    vocab_size=VOCAB_SIZE,
    embed_grad_scale=1,
    parallel_output=True,
    hidden_size=HIDDEN_SIZE,
    num_layers=NUM_LAYER,
    mlp_ratio=MLP_RATIO,
    apply_post_layer_norm=False,
    dtype="torch.bfloat16",  # "torch.float16", "torch.half", "torch.bfloat16", "torch.float32", "torch.tf32"
    norm_type="rmsnorm",
    layer_norm_epsilon=1e-5,
    use_flash_attn=True,
    num_chunks=1,  # >1: interleaved pipeline schedule
)

parallel = dict(
    zero1=dict(size=-1, fsdp=False),  # shard parameters, gradients and AdamW state over all data-parallel ranks
    tensor=4,
    pipeline=dict(size=1, interleaved_overlap=True),
    sequence_parallel=True,
)

cudnn_deterministic = False
cudnn_benchmark = False

monitor = dict(
    alert=dict(
        enable_feishu_alert=DO_ALERT,
        feishu_alert_address=None,  # or env INTERNLM_FEISHU_ALERT_ADDRESS
        light_monitor_address=None,
    ),
)
