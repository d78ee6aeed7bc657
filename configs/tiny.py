# A model small enough to train 50 steps on 2 CPU cores in about a minute (demo, tests).
# Without data.train_folder it trains on random Zipf-distributed tokens (loss falls toward their entropy);
# `make demo` points it at a corpus tokenized from Python's standard library.
JOB_NAME = "tiny"

SEQ_LEN = 256
data = dict(
    seq_len=SEQ_LEN,
    micro_num=2,
    micro_bsz=2,
    valid_micro_num=2,
    valid_every=25,
    total_steps=50,
    min_length=0,
    train_folder=None,
    valid_folder=None,
    dummy_distribution="zipf",
    fixed_random_dataset_seqlen=False,
)

model_type = "INTERNLM"
model = dict(
    num_layers=2,
    hidden_size=128,
    num_attention_heads=4,
    vocab_size=512,
    mlp_ratio=8 / 3,
    multiple_of=64,
    dtype="torch.float32",
    checkpoint=False,
    use_flash_attn=True,  # used on CUDA when installed; SDPA with document masks otherwise
)

parallel = dict(zero1=-1, tensor=1, pipeline=1)

adam = dict(lr=3e-3, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.01)
lr_scheduler = dict(warmup_ratio=0.1, eta_min=3e-4)
hybrid_zero_optimizer = dict(clip_grad_norm=1.0)
loss = dict(label_smoothing=0)

ckpt = dict(enable_save_ckpt=False, save_ckpt_folder=None, checkpoint_every=25, auto_resume=True)
monitor = dict(log_every=5)
