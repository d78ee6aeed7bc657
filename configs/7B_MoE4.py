# InternEvo's 7B_MoE4_sft.py shape: the InternLM-7B block (32 layers, hidden 4096, 32 heads, bias on q/k/v/o)
# with 4 experts of width 5632 (mlp_ratio 4/3) in every FFN, top-2 GShard routing: 11,852,320,768 parameters.
# Layout (tools/estimate.py --config configs/7B_MoE4.py --gpus 8, 80 GiB GPUs, bf16, seq 2048): FSDP over dp 8,
# expert parallel 4 (experts FSDP over the 2 ranks left): 48.5 GiB per GPU <- the `parallel` below.
JOB_NAME = "7b_moe4_train"
DO_ALERT = False

SEQ_LEN = 2048
HIDDEN_SIZE = 4096
NUM_ATTENTION_HEAD = 32
MLP_RATIO = 4 / 3
NUM_LAYER = 32
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
    micro_num=4,  # micro-batches per step (gradient accumulation)
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

loss = dict(label_smoothing=0, moe_loss_coeff=0.1)

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

model_type = "INTERNLM_MoE"
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
    num_experts=4,
    moe_type="GShard",  # GShard, MegaBlock (capacity-bounded) or Dropless, MegaBlock-Dropless
)

parallel = dict(
    zero1=dict(size=8, fsdp=False),
    tensor=1,
    pipeline=dict(size=1, interleaved_overlap=True),
    sequence_parallel=False,
    expert=dict(size=-1, no_tp=False),  # -1: as many of the data-parallel ranks as there are experts (4 on 8 GPUs)
)

moe = dict(top_k=2, capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=4, noisy_gate_policy=None,
           drop_tokens=True, use_rts=True)

cudnn_deterministic = False
cudnn_benchmark = False

monitor = dict(
    alert=dict(
        enable_feishu_alert=DO_ALERT,
        feishu_alert_address=None,  # or env INTERNLM_FEISHU_ALERT_ADDRESS
        light_monitor_address=None,
    ),
)
