# A ~1.1B Llama-style model (TinyLlama's shape) for one GPU: bf16, flash-attn's varlen kernel when importable
# (model.attn_backend="auto"; SDPA with document masks otherwise), torch fused AdamW (apex when installed).
# The GPU check (tools/gpu_check.sh, bench/gpu_rows.py) trains it 3 steps for its peak-memory row (the CUDA
# allocator's peak beside estimate(device="cuda")), reads its kernel choice, and trains it 30 steps eager and under
# model.compile for its speed rows (bench/gpu_rows_speed.py: tokens/s and MFU beside the estimator's prediction,
# `tools/estimate.py --config configs/bench_gpu.py --gpu h200`).
# Throughput: 30 steps, tokens/s per GPU (tgs) and MFU on the console line and in metrics.jsonl:
#   python train.py --config configs/bench_gpu.py [--set model.compile=True]
JOB_NAME = "bench_gpu"

SEQ_LEN = 2048
data = dict(
    seq_len=SEQ_LEN,
    micro_bsz=8,            # 8 x 2048 = 16,384 tokens per micro-batch
    micro_num=1,
    total_steps=30,
    train_folder=None,      # dummy data: Zipf tokens, documents of random length (packed, document-masked)
    dummy_distribution="zipf",
    fixed_random_dataset_seqlen=False,
    dummy_num_samples=20000,
    valid_every=0,
    num_worker=1,           # batches prepared by a background thread
)

model_type = "LLAMA"
model = dict(
    num_layers=22,
    hidden_size=2048,
    num_attention_heads=32,
    num_kv_attention_heads=4,
    intermediate_size=5632,
    vocab_size=32000,
    layer_norm_epsilon=1e-5,
    rope_base=1e4,
    tie_word_embeddings=False,
    dtype="torch.bfloat16",
    checkpoint=False,
    compile=False,
    use_flash_attn=True,
    attn_backend="auto",
)

parallel = dict(zero1=-1, tensor=1, pipeline=1)

adam = dict(lr=3e-4, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.1, fused="auto")
lr_scheduler = dict(warmup_ratio=0.1, eta_min=3e-5)
hybrid_zero_optimizer = dict(clip_grad_norm=1.0)
loss = dict(label_smoothing=0)

ckpt = dict(enable_save_ckpt=False, save_at_end=False, auto_resume=False)
monitor = dict(log_every=5, tensorboard=False)
