# InternLM2-7B's shape (GQA: 32 query and 8 key/value heads, FFN 14336) trained on 131,072-token sequences with
# context parallel: each sequence is cut into 2 * C zigzag chunks over C ranks (README "Long context").
#
# Recommended layout on 64 GPUs (tools/estimate.py --gpus 64: bf16, activation checkpointing, FSDP over all 64
# ranks = data 8 x context 8), per GPU:
#   context=dict(size=8, mode="all_to_all")  16,384 tokens per rank (8 k/v heads: one per rank); peak 11.9 GiB
#       (activations 7.1, parameters 0.45, AdamW 0.9), 17.5 GiB sent per step in all-to-alls   <- set below
#   context=dict(size=8, mode="ring")         the same memory; 60 GiB sent per step (k/v and their fp32 gradients
#       travel around the ring): for head counts all_to_all cannot split
#   context=dict(size=16, mode="2d", inner=8) data 4: peak 8.4 GiB, 14.8 GiB sent (all-to-all inside 8, ring of 2)
#   context=dict(size=4, mode="all_to_all")   data 16: peak 19.0 GiB, 30 GiB sent per step
# Estimated, not measured on GPUs (no GPU here); `tools/estimate.py --config configs/7B_128k.py --gpus 64`.
JOB_NAME = "7b_128k"

SEQ_LEN = 131072
data = dict(
    seq_len=SEQ_LEN,
    micro_num=1,
    micro_bsz=1,
    valid_micro_num=1,
    valid_every=0,
    pack_sample_into_one=False,  # documents stay separate inside each 128K row (attention within a document)
    total_steps=10000,
    min_length=0,
    train_folder=None,  # e.g. "/path/to/tokenized/train/" (long documents)
    valid_folder=None,
)

model_type = "INTERNLM2"
model = dict(
    num_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_kv_attention_heads=8,
    intermediate_size=14336,
    vocab_size=92544,
    rope_base=1_000_000.0,  # a large rotary base: positions up to 128K stay distinguishable
    dtype="torch.bfloat16",
    # Memory policies, by `tools/estimate.py --config configs/7B_128k.py --gpus 64` (peak per GPU, 16K tokens per
    # rank): checkpoint=True 11.9 GiB; "selective" 58.0 GiB and 0.5 51.0 GiB (every kept layer's matmul outputs at
    # 16K tokens); none 90 GiB. Recomputing the blocks is what makes the activations fit.
    checkpoint=True,
    # the fused head drops the 2.8 GiB of logits; its two fp32 chunks and the head's gradient take part of it back:
    # 11.4 GiB against 11.9, for one more head matmul per micro-batch (the logits recomputed in backward). "auto"
    # (the estimator's choice) fuses it here
    fused_head_loss="auto",
    # offload (the recomputed layers' inputs, 4.5 GiB, to the host) would lower the peak to 7.9 GiB, its copies
    # hidden by the ~8 s step; not needed at 11.9 GiB: off (on for GPUs under 16 GiB)
    offload_activations=False,
    use_flash_attn=True,
)

parallel = dict(zero1=-1, tensor=1, pipeline=1, context=dict(size=8, mode="all_to_all"))

adam = dict(lr=3e-5, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.01)
lr_scheduler = dict(warmup_ratio=0.01, eta_min=3e-6)
hybrid_zero_optimizer = dict(clip_grad_norm=1.0)
loss = dict(label_smoothing=0)
ckpt = dict(enable_save_ckpt=False, save_ckpt_folder="llm_ckpts/7b_128k", checkpoint_every=100, auto_resume=True)
