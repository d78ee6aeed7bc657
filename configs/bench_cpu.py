# The peer benchmark's workload (../shared/bench/peers/workload.py) through the real train.py path.
# `make bench` (bench/run.py) trains it next to the peers and compares; by hand:
#   python train.py --config configs/bench_cpu.py --run-dir build/bench/manual
#   python train.py --config configs/bench_cpu.py --set model.dtype=torch.bfloat16 model.compile=True
#
# Same shape (Llama-style, 7,358,720 parameters), optimizer, clipping, schedule and tokens per step
# (4 x 512 = 2048) as the peers; the data is the same distribution (i.i.d. Zipf s=1.1 over the token ids,
# id = frequency rank, documents of exactly seq_len tokens), drawn by our dummy source rather than the
# peers' RandomState(0) stream, so losses agree in size, not bit for bit.
# The lr schedule is InternLM's: warm-up lr*(t+1)/10 for t < 10 (the peers' HF schedule uses t/10, one
# step later), then the same cosine to 0 at step 35.
JOB_NAME = "bench_cpu"

SEQ_LEN = 512
STEPS = 35
WARMUP = 10

data = dict(
    seq_len=SEQ_LEN,
    micro_bsz=4,            # 4 documents of 512 tokens per row: 2048 tokens per micro-batch
    micro_num=1,            # one micro-batch per optimizer step (the peers' batch of 4)
    total_steps=STEPS,
    train_folder=None,      # dummy data
    dummy_distribution="zipf",
    fixed_random_dataset_seqlen=True,
    dummy_num_samples=STEPS * 4,
    valid_every=0,
    num_worker=0,
)

model_type = "LLAMA"
model = dict(
    num_layers=4,
    hidden_size=256,
    num_attention_heads=4,
    num_kv_attention_heads=4,
    vocab_size=8192,
    intermediate_size=688,
    layer_norm_epsilon=1e-6,
    rope_base=1e4,
    tie_word_embeddings=False,
    init_std=0.02,
    dtype="torch.float32",  # bench/run.py also runs torch.bfloat16 and model.compile=True
    checkpoint=False,
    compile=False,
    use_flash_attn=True,    # CUDA only; SDPA on CPU
)

parallel = dict(zero1=-1, tensor=1, pipeline=1)

adam = dict(lr=3e-4, adam_beta1=0.9, adam_beta2=0.95, adam_beta2_c=0.0, adam_eps=1e-8, weight_decay=0.1,
            fused="torch")
lr_scheduler = dict(warmup_ratio=WARMUP / STEPS, eta_min=0.0)
hybrid_zero_optimizer = dict(clip_grad_norm=1.0)
loss = dict(label_smoothing=0)

ckpt = dict(enable_save_ckpt=False, save_at_end=False, auto_resume=False)
monitor = dict(log_every=5)
