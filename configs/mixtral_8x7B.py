# Mixtral-8x7B's shape (32 layers, hidden 4096, 32 query heads, 8 key/value heads, 8 experts of SwiGLU width 14336,
# top-2 dropless routing, vocabulary 32000: 46,702,792,704 parameters, 12.9 B active per token), in InternLM's keys.
# Layouts (tools/estimate.py --config configs/mixtral_8x7B.py --gpus N --set ..., 80 GiB GPUs, bf16, seq 4096,
# micro_bsz 1, micro_num 8; tensor parallel replicates the routed experts over the tensor ranks (InternEvo's no_tp), so
# it does not shrink them: tensor 2 x expert 8 needs 61.3 GiB, no less than tensor 1):
#   64 GPUs:  pipeline 1, FSDP over dp 64, expert parallel 8 (experts FSDP over the 8 left): 51.8 GiB  <- below
#   64 GPUs:  pipeline 4, FSDP over dp 16, expert parallel 8:                                    53.9 GiB
#   128 GPUs: pipeline 1, FSDP over dp 128, expert parallel 8:                                  46.4 GiB
# Rank 0 of 64 simulated on a CPU (bench/simulate_table.py --cases mixtral@64: seq 128, 4 micro-batches, bf16):
# see the README's table.
JOB_NAME = "mixtral_8x7b_train"
DO_ALERT = False

SEQ_LEN = 4096
HIDDEN_SIZE = 4096
NUM_ATTENTION_HEAD = 32
NUM_KV_ATTENTION_HEAD = 8
INTERMEDIATE_SIZE = 14336  # each expert's SwiGLU width
NUM_LAYER = 32
VOCAB_SIZE = 32000
NUM_EXPERTS = 8
PIPELINE = 1
EXPERT = -1  # all of the sharded data-parallel ranks, at most one per expert (InternEvo)
MICRO_BSZ = 1

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
    micro_bsz=MICRO_BSZ,  # sequences packed into one micro-batch row
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

loss = dict(label_smoothing=0, moe_loss_coeff=0.02)

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

model_type = "MIXTRAL"
use_fp32_norm = False
model = dict(
    checkpoint=False,  # activation checkpointing: True, False, or a fraction of the layers
    num_attention_heads=NUM_ATTENTION_HEAD,
    num_kv_attention_heads=NUM_KV_ATTENTION_HEAD,
    embed_split_hidden=True,
    vocab_size=VOCAB_SIZE,
    embed_grad_scale=1,
    parallel_output=True,
    hidden_size=HIDDEN_SIZE,
    num_layers=NUM_LAYER,
    intermediate_size=INTERMEDIATE_SIZE,
    rope_base=1000000.0,
    apply_post_layer_norm=False,
    dtype="torch.bfloat16",  # "torch.float16", "torch.half", "torch.bfloat16", "torch.float32", "torch.tf32"
    norm_type="rmsnorm",
    layer_norm_epsilon=1e-5,
    use_flash_attn=True,
    num_chunks=1,  # >1: interleaved pipeline schedule
    num_experts=NUM_EXPERTS,
    moe_type="Dropless",  # Mixtral routes every token to its top 2 experts
)

moe = dict(top_k=2, norm_topk_prob=True)

parallel = dict(
    zero1=dict(size=-1, fsdp=False),  # shard parameters, gradients and AdamW state over all data-parallel ranks
    tensor=1,  # tensor parallel of MoE models is not implemented yet
    pipeline=dict(size=PIPELINE, interleaved_overlap=True),
    expert=dict(size=EXPERT, no_tp=False),  # experts sharded over EXPERT data-parallel ranks
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
