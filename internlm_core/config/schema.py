"""The typed config: one dataclass per section of an InternLM config file.

Every field carries its meaning in `metadata["help"]`; the README's config reference is generated
from these (`python -m internlm_core.config.reference`), so the two cannot drift apart.
Key names are InternLM's (configs/7B_sft.py at commit aaaf4d7); new keys follow the same style.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union

from .ckpt_names import CONTENTS


def f(default: Any = None, help: str = "", factory: Any = None,  # noqa: A002 - `help` reads best here
      compat: Union[bool, str] = False) -> Any:
    """A dataclass field with its documentation. `compat`: the field exists only to keep an InternLM/InternEvo key
    (True: the key of the same name; a string: InternLM's dotted spelling inside the section, e.g. "zero1.fsdp");
    compat.py reads these marks, so the schema is the one list of the compatibility keys it keeps."""
    metadata = {"help": help, "compat": compat} if compat else {"help": help}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class DataConfig:
    """Training and validation data, batch shape and step count."""

    seq_len: int = f(2048, "Maximum tokens of one sequence; attention never spans more than this.")
    micro_num: int = f(1, "Micro-batches per optimizer step and data-parallel rank (gradient accumulation).")
    micro_bsz: int = f(1, "Sequences of `seq_len` packed into one micro-batch row.")
    packed_length: Optional[int] = f(None, "Tokens in one packed row; default `seq_len * micro_bsz`.")
    valid_micro_num: Optional[int] = f(None, "Micro-batches per validation step; default `micro_num`.")
    valid_every: int = f(0, "Validate every this many steps (0: never, except at the end if `valid_folder` is set).")
    pack_sample_into_one: bool = f(False, "Treat a packed row as one sequence (attention crosses documents), as InternLM.")
    total_steps: int = f(50000, "Number of batches (optimizer steps) to train.")
    skip_batches: str = f("", "Batches to skip, e.g. \"3,10-20\" (inclusive ranges, 0-based batch counts).")
    rampup_batch_size: str = f("", "InternLM's batch-size ramp-up \"start increment every\": micro-batches per step start at `start` and grow by `increment` every `every` steps up to `micro_num` (e.g. \"2 1 10\"); empty: none. Not with pipeline parallel.")
    min_length: int = f(0, "Drop documents with fewer tokens than this.")
    train_folder: Optional[str] = f(None, "Folder of tokenized `.bin`/`.bin.meta` files; None: random dummy data.")
    valid_folder: Optional[str] = f(None, "Folder of validation `.bin` files, one dataset per subfolder; None: no validation data.")
    num_worker: int = f(0, "Data loader worker processes (0: load in the training process).")
    empty_cache_and_diag_interval: int = f(10, "Every this many steps, gather step times across ranks and report stragglers.")
    diag_outlier_ratio: float = f(1.1, "A rank whose step time exceeds this ratio of the mean is reported as a straggler.")
    fixed_random_dataset_seqlen: bool = f(True, "Dummy data: every document exactly `seq_len` tokens (else random lengths).")
    dummy_distribution: str = f("uniform", "Dummy data token distribution: \"uniform\" or \"zipf\" (Zipf s=1.1 over token ids).")
    dummy_num_samples: int = f(100000, "Number of documents in the dummy dataset.")
    dataset_type_mode: str = f("subfolder", "How dataset type ids are named: \"subfolder\" (InternEvo: top-level subfolder of train_folder; validation sets by top-level subfolder of valid_folder) or \"internlm\" (InternLM's rules: fixed en/cn/code mapping by a folder of the file's path, validation sets named by each folder holding .bin files).")
    seed: Optional[int] = f(None, "Seed of the data order; default the run's `--seed`.")
    type: str = f("tokenized", "Training data (InternEvo's key): \"tokenized\" (`.bin` files: ours, InternLM's, Megatron's `.bin`/`.idx`; \"megatron\" is the same) or \"streaming\" (jsonl / parquet / Hugging Face `datasets` folders under `train_folder`, tokenized on the fly).")
    dataset_weights: Optional[dict] = f(None, "Mixture weights {dataset type: weight > 0}, one for every type of `train_folder` (see dataset_type_mode); each type's share of the training tokens, held over any window of rows. None: documents of all types shuffled together (their natural shares).")
    index_cache_folder: Optional[str] = f(None, "Where the training index (document lengths, shuffled order, row starts) is cached, built once and read by every rank; default `.index_cache` inside `train_folder` (or `~/.cache/internlm_core/index/...` when that is not writable).")
    tokenizer_path: Optional[str] = f(None, "Streaming: the tokenizer (`byte`, a SentencePiece `.model`, a `tokenizer.json` or a folder holding one); BOS and EOS are put around every document.")
    content_name: str = f("text", "Streaming: the field of each record that holds its text (InternEvo's key).")


@dataclass
class ModelConfig:
    """Model shape and numerics (InternLM's `model` section)."""

    num_layers: int = f(32, "Transformer blocks.")
    hidden_size: int = f(4096, "Model width.")
    num_attention_heads: int = f(32, "Query heads.")
    num_kv_attention_heads: Optional[int] = f(None, "Key/value heads (grouped-query attention); default `num_attention_heads`.")
    vocab_size: int = f(103168, "Vocabulary size (embedding and output rows).")
    mlp_ratio: float = f(8 / 3, "FFN width = hidden_size * mlp_ratio, rounded up to a multiple of `multiple_of`.")
    multiple_of: int = f(256, "FFN width is rounded up to a multiple of this (InternLM's FeedForward).")
    intermediate_size: Optional[int] = f(None, "Explicit FFN width; overrides mlp_ratio/multiple_of.")
    checkpoint: Union[bool, float, str] = f(False, "Activation checkpointing: \"full\" (or True: every block recomputed whole in backward from its input), \"selective\" (per operator, torchtitan's policy: the outputs of matmuls, attention kernels and collectives kept, the elementwise ops recomputed; MoE's all-to-alls and context parallel's exchanges never repeated; refused with context parallel's ring, whose first step hung, and with the split-backward pipeline schedules; parallel/activation_checkpoint.py SAVE_LIST), a fraction in [0, 1] (the first round(fraction * layers) blocks of each stage recomputed whole), or False.")
    fused_head_loss: Union[bool, str] = f("auto", "The output layer and the cross entropy computed together, chunk by chunk (fused_head.py): forward by chunks of tokens, backward by chunks of vocabulary rows (each chunk's weight gradient whole, no fp32 accumulator of the weight's size); the [tokens, vocab] logits never exist whole; label smoothing, z-loss, ACC/PPL as unfused; vocabulary-parallel under tensor parallel. Under pipeline parallel the last stage stops before its output layer and its loss applies it; under tensor + sequence parallel the head's sequence-sharded input is gathered. Costs one more head matmul per micro-batch (the logits recomputed in backward). \"auto\" (default): fused where the estimator puts the peak per device at least 256 MiB lower with it, on this device's loss kernel (estimate/fused_choice.py; tools/estimate.py and --dry-run say which and by how much): e.g. configs/7B_128k.py on GPUs, not Qwen3-8B at 4K tokens with flash-attn's in-place loss, not small models. True / False force it. Callbacks' on_micro_batch_end then gets the head's input instead of the logits.")
    dtype: str = f("torch.bfloat16", "Compute dtype: torch.float32, torch.tf32, torch.bfloat16, torch.float16 (or torch.half).")
    norm_type: str = f("rmsnorm", "Normalization: rmsnorm (the only one InternLM ships for these models).")
    layer_norm_epsilon: float = f(1e-5, "Epsilon of the norms.")
    use_flash_attn: bool = f(True, "Use flash-attn's kernels when installed and working, on CUDA, with 16-bit compute (bf16/fp16); else SDPA (CPU: blocked matmul attention).")
    num_chunks: int = f(1, "Model chunks (virtual stages) per pipeline rank (>1: interleaved 1F1B, or parallel.pipeline_schedule's).")
    embed_split_hidden: bool = f(True, "InternLM's embedding split; kept for config compatibility (DTensor decides sharding).", compat=True)
    embed_grad_scale: float = f(1.0, "Scale of the embedding's gradient (InternLM's embed_grad_scale).")
    parallel_output: bool = f(True, "Keep logits vocab-parallel under tensor parallel; the loss handles sharded logits.")
    apply_post_layer_norm: bool = f(False, "Post-norm blocks instead of pre-norm.")
    rope_base: float = f(10000.0, "Rotary embedding base (theta).")
    tie_word_embeddings: bool = f(False, "Share the embedding and output matrices.")
    init_std: float = f(0.02, "Std of the normal initialization of matrices.")
    qkv_bias: Optional[bool] = f(None, "Bias on q/k/v/o projections; default: True for INTERNLM, False for INTERNLM2/LLAMA.")
    use_fp32_norm: bool = f(False, "Keep norm weights and computation in fp32 under low-precision dtypes.")
    compile: bool = f(False, "torch.compile each transformer block.")
    fp8: Optional[Union[bool, str, dict]] = f(None, "Float8 training of the linear layers through torchao (optional dependency, imported only when set; refused if it does not import): None / False / \"off\" (default), \"tensorwise\" (True), \"rowwise\" or \"rowwise_with_gw_hp\" (torchao's recipe names), \"mxfp8\" (= \"mxfp8_rceil\"), \"mxfp8_rceil_wgrad_with_hp\" or \"mxfp8_emulated_rceil\" (torchao's MXFP8 training: dense linears and, on the grouped GEMM, the MoE experts; emulated on CPU, CUDA needs SM >= 10.0), or torchtitan's float8 section as a dict(recipe_name, enable_fsdp_float8_all_gather, filter_fqns, min_features). Kept in high precision: embeddings, the output head, MoE routing, linears with a dimension not a multiple of 16 or below min_features (default 64), names containing filter_fqns (config/fp8.py). Tensor parallel: torchao's float8 styles (tensorwise), DTensor's (rowwise); mxfp8 not with parallel.tensor > 1. The float8 all-gather (tensorwise) also on gloo (sent as bytes).")
    offload_activations: bool = f(False, "Activation offload: what each transformer block's forward saves for backward is copied to pinned host memory (a side CUDA stream, overlapped with compute) and back in backward (the next block's prefetched); tensors under 16 KiB and parameters stay on the device. Under model.checkpoint only what the checkpoint saves (the blocks' inputs) moves. Under tensor parallel the saved DTensors' local tensors move (parallel/offload.py).")
    attn_backend: str = f("auto", "Attention kernel: auto (on GPUs with 16-bit compute flash-attn if usable, else torch's varlen kernel, else sdpa; cpu_blocked on CPU), flash or torch_varlen (fp32 inputs cast to bf16; refused where they cannot run), sdpa, cpu_blocked.")
    num_experts: int = f(0, "Experts of each mixture-of-experts FFN (MoE families: INTERNLM_MoE, MIXTRAL, ...); 0 for dense models.")
    moe_type: str = f("GShard", "MoE routing (InternEvo's names): GShard or MegaBlock (capacity-bounded, tokens over capacity dropped unless moe.drop_tokens is False), Dropless or MegaBlock-Dropless (every token reaches its top_k experts).")
    moe_use_residual: bool = f(False, "Residual MoE (InternEvo): a dense SwiGLU beside the experts, mixed with them by a learned per-token coefficient.")
    moe_intermediate_size: Optional[int] = f(None, "Each expert's FFN width; default the dense FFN width (intermediate_size, or mlp_ratio/multiple_of).")
    first_k_dense_replace: int = f(0, "MoE families: blocks 0 .. k-1 keep the dense FFN (width intermediate_size) instead of the experts (DeepSeek's key; model/moe/mix.py). 0: none.")
    decoder_sparse_step: int = f(1, "MoE families: only blocks i with (i + 1) % step == 0 have the experts, the others the dense FFN (Qwen-MoE's key). 1: every block.")
    mlp_only_layers: Optional[list] = f(None, "MoE families: these blocks (indices) keep the dense FFN whatever the other keys (Qwen-MoE's key). None: none.")
    num_shared_experts: int = f(0, "DEEPSEEK_V3: shared experts, a dense SwiGLU of width num_shared_experts * moe_intermediate_size every token passes, added to the routed experts' output (DeepSeek's n_shared_experts; InternEvo's coefficient-mixed one is moe_use_residual).")
    q_lora_rank: Optional[int] = f(None, "DEEPSEEK_V3's multi-head latent attention: rank of the low-rank query (wq_a, its RMSNorm, wq_b); None: a full-rank query projection (Moonlight, DeepSeek-V2-Lite).")
    kv_lora_rank: Optional[int] = f(None, "DEEPSEEK_V3's multi-head latent attention: width of the compressed key/value latent every head's keys and values are expanded from (DeepSeek-V3: 512).")
    qk_nope_head_dim: Optional[int] = f(None, "DEEPSEEK_V3: channels of each query / key head without rotary embedding (DeepSeek-V3: 128).")
    qk_rope_head_dim: Optional[int] = f(None, "DEEPSEEK_V3: channels of each query head with rotary embedding, and of the one rotary key all heads share (DeepSeek-V3: 64).")
    v_head_dim: Optional[int] = f(None, "DEEPSEEK_V3: channels of each value head (DeepSeek-V3: 128; the q/k heads have qk_nope_head_dim + qk_rope_head_dim).")
    head_dim: Optional[int] = f(None, "Channels of each attention head; default hidden_size / num_attention_heads (Qwen3 sets 128 at every width).")
    qk_norm: Optional[bool] = f(None, "RMSNorm over each head's channels on q and k before the rotary embedding (Qwen3); default: True for QWEN3 / QWEN3_MoE, False otherwise.")
    sliding_window: Optional[int] = f(None, "Sliding-window attention: each token attends to at most this many tokens of its document, itself included (Mistral); None: the whole document.")
    window_layers: Optional[list] = f(None, "The layers (indices) model.sliding_window applies to, the others attending to the whole document (Qwen2/Qwen3's max_window_layers, transformers' layer_types); None: every layer.")
    rope_scaling: Optional[dict] = f(None, "Rotary frequency scaling, InternLM2's / transformers' spelling: dict(type=\"linear\" or \"dynamic\", factor=f) (dynamic NTK takes original_max_position_embeddings, default data.seq_len: no change) or dict(rope_type=\"llama3\", factor, low_freq_factor, high_freq_factor, original_max_position_embeddings); None: none.")
    mtp: Optional[Union[int, dict]] = f(None, "Multi-token prediction (DeepSeek-V3's MTP, model/mtp.py): dict(depth=D, loss_weight=w) (or D alone; loss_weight default 0.3): D extra modules on the last stage, depth k predicting the token k + 1 ahead from the previous depth's hidden state and the embedding of the token k ahead through one block of the family, the shared embedding and output layer; their loss, the mean over depths of each one's cross entropy, counts w times in the trained loss and is reported as mtp_loss. Also spelled model.num_nextn_predict_layers (DeepSeek) and model.mtp_num_layers / mtp_loss_scaling_factor (Megatron). None / 0: off. Not with tensor parallel nor the fused head.")


@dataclass
class MoEConfig:
    """Mixture-of-experts routing (InternEvo's `moe` section); used by MoE families only."""

    top_k: int = f(2, "Experts each token is routed to (InternEvo also spells it model.top_k, InternLM-develop moe_gate_k).")
    capacity_factor: float = f(1.0, "GShard: each expert takes at most capacity_factor * top_k * tokens / num_experts tokens in training.")
    eval_capacity_factor: float = f(1.0, "GShard: the capacity factor in evaluation.")
    min_capacity: int = f(4, "GShard: the least capacity of an expert.")
    noisy_gate_policy: Optional[str] = f(None, "Router noise in training: None, Jitter (multiplicative uniform noise on the router input) or RSample (Gumbel noise on the logits for top-1 selection).")
    drop_tokens: bool = f(True, "GShard: drop the tokens over an expert's capacity (False: the capacity grows to the busiest expert's load).")
    use_rts: bool = f(True, "GShard: random token selection when an expert is over capacity (else the first tokens win).")
    score_func: str = f("softmax", "Router scores: softmax or sigmoid.")
    norm_topk_prob: bool = f(True, "Renormalize each token's top_k routing weights to sum to 1 (Mixtral, Qwen3-MoE).")
    z_loss_coeff: float = f(0.0, "Router z-loss coefficient (ST-MoE); 0: off.")
    expert_bias_update_rate: float = f(0.0, "Aux-loss-free balancing (DeepSeek-V3): per-expert bias on the selection scores, moved by this rate toward balance after each step; 0: off.")
    num_expert_groups: int = f(1, "DEEPSEEK_V3's group-limited routing (DeepSeek's n_group): the experts form this many equal groups, each scored by the sum of its 2 best selection scores; 1: no groups.")
    top_k_groups: int = f(1, "DEEPSEEK_V3: each token picks its top_k experts among its top_k_groups best groups only (DeepSeek's topk_group).")
    routed_scaling_factor: float = f(1.0, "DEEPSEEK_V3: the routed experts' combine weights are multiplied by this after norm_topk_prob (DeepSeek-V3: 2.5).")
    expert_gemm: str = f("auto", "How the experts multiply: auto (torch's grouped GEMM on CUDA where it runs for the compute dtype, one GEMM per expert otherwise), loop, grouped; chosen once in numerics/.")


@dataclass
class ContextConfig:
    """Context parallel (`parallel.context=N` or dict(size, mode, inner)): ranks sharing each sequence.

    The ranks of one context group read the same rows and each keeps the zigzag chunks r and 2*size-1-r of every
    sequence (equal causal work); attention exchanges keys/values or heads between them."""

    size: int = f(1, "Ranks sharing each sequence (1: off); data parallel = world / (tensor * pipeline * size); data.seq_len must be divisible by 2 * size.")
    mode: str = f("ring", "ring (keys/values pass around the ranks; any head count), all_to_all (Ulysses: heads exchanged; heads per tensor-parallel rank divisible by size), 2d (all_to_all within groups of `inner` ranks, ring across them; InternEvo's sequence_2D).")
    inner: int = f(1, "2d: ranks of each all-to-all (head) group, dividing size; InternEvo's head_size (the dict also takes head_size).")


@dataclass
class FaultToleranceConfig:
    """Replica groups that survive the loss of a group (torchft; torchtitan's `fault_tolerance` section): each group
    is its own torchrun job holding the whole model (FSDP inside it); a lighthouse forms a quorum every step, the
    gradients are averaged over the groups in it, and a group that (re)joins heals from a live peer."""

    enable: bool = f(False, "Train as one replica group of several (needs the torchft package and a running lighthouse: tools/ft_local.sh, tools/slurm/train_ft.sbatch).")
    replica_id: int = f(0, "This replica group's index, 0 .. group_size - 1; it reads that share of every global batch.")
    group_size: int = f(1, "Number of replica groups (torchtitan's fault_tolerance.group_size); each reads 1/group_size of every global batch.")
    lighthouse: Optional[str] = f(None, "The lighthouse's address, e.g. http://host:29510; None: the TORCHFT_LIGHTHOUSE environment variable.")
    min_replicas: int = f(1, "Fewest replica groups a step may commit with; with fewer the step waits (quorum_timeout) or is not committed.")
    timeout: float = f(60.0, "Seconds for the all-reduce across groups, the commit vote and a heal's state transfer before they count as failed.")
    quorum_timeout: float = f(60.0, "Seconds a step waits for its quorum from the lighthouse before the run stops (lighthouse gone).")
    max_retries: int = f(10, "Stop after this many consecutive attempts of one step that the groups did not commit.")


@dataclass
class ParallelConfig:
    """Parallel layout (InternLM's `parallel` section); data parallel = world / (tensor * pipeline * context size)."""

    zero1: int = f(-1, "Optimizer/parameter sharding: <=0 shard over the whole data-parallel group, 1 none, k within groups of k (HSDP).")
    zero1_fsdp: bool = f(False, "InternLM's zero1=dict(fsdp=...); sharding here is always FSDP2 when zero1 != 1.", compat="zero1.fsdp")
    tensor: int = f(1, "Tensor-parallel size.")
    pipeline: int = f(1, "Pipeline-parallel size.")
    pipeline_schedule: str = f("auto", "Pipeline schedule (torch.distributed.pipelining; config/pipeline.py): auto (1f1b with model.num_chunks 1, else interleaved), 1f1b, interleaved (model.num_chunks > 1 stages per rank), interleaved_zb (zero bubble ZB1P: backward split into input and weight passes, any num_chunks), zbv or dualpipev (split backward, two stages per rank in V order: model.num_chunks=2; dualpipev needs micro_num >= 2 * pipeline). The split-backward ones refuse model.compile, model.checkpoint='selective' and model.fused_head_loss=True (\"auto\" keeps the head unfused there). InternEvo's pipeline=dict(zero_bubble=True) maps to interleaved_zb (num_chunks 1) or zbv (2).")
    interleaved_overlap: bool = f(True, "Pipeline: overlap communication in the interleaved schedule.", compat="pipeline.interleaved_overlap")
    sequence_parallel: bool = f(False, "Shard activations along the sequence in norms/dropout under tensor parallel.")
    context: ContextConfig = f(factory=ContextConfig, help="Context parallel: an int (the size) or dict(size, mode, inner); see ContextConfig.")
    fault_tolerance: FaultToleranceConfig = f(factory=FaultToleranceConfig, help="Replica groups over torchft; see FaultToleranceConfig.")
    dims: dict = f(help="Sizes of the parallel dimensions the model family adds (its plan's mesh_dims), by key; "
                        "written as `parallel.<key>=N` (e.g. a family's expert dimension), collected here.",
                   factory=dict)


@dataclass
class AdamConfig:
    """AdamW hyper-parameters (InternLM's `adam` section)."""

    lr: float = f(1e-4, "Peak learning rate.")
    adam_beta1: float = f(0.9, "Adam beta1.")
    adam_beta2: float = f(0.95, "Adam beta2 (initial value for the beta2 schedule).")
    adam_beta2_c: float = f(0.0, "Beta2 schedule constant c (0: constant beta2).")
    adam_eps: float = f(1e-8, "Adam epsilon.")
    weight_decay: float = f(0.01, "Weight decay on matrices; norms, biases and 1-D parameters get none.")
    fused: str = f("auto", "Optimizer kernel: auto (apex FusedAdam if it works on CUDA and the parameters are plain tensors: one process, no FSDP or tensor parallel; else torch fused), torch, apex.")


@dataclass
class OptimizerConfig:
    """Which optimizer (InternLM's `adam` section configures AdamW, and Muon's AdamW part, lr and weight decay)."""

    name: str = f("adamw", "adamw (every parameter) or muon: Muon (momentum, then Newton-Schulz orthogonalization of each whole matrix) for the >= 2-D weights inside the transformer blocks (attention and MLP matrices, each MoE expert's matrix on its own), AdamW (the `adam` keys) for the rest: embeddings, the output head, norms, biases and the MoE routers. Both use adam.lr and adam.weight_decay (decoupled) and the lr schedule; Muon's update is scaled by muon_rms_scale * sqrt(max(rows, columns)) to match AdamW's update RMS (Moonlight).")
    muon_momentum: float = f(0.95, "Muon: momentum of the gradient average (buffer = lerp(buffer, grad, 1 - momentum)).")
    muon_nesterov: bool = f(True, "Muon: orthogonalize lerp(grad, buffer, momentum) (Nesterov) instead of the buffer.")
    muon_ns_steps: int = f(5, "Muon: Newton-Schulz iterations.")
    muon_ns_coefficients: tuple = f(None, "Muon: the quintic Newton-Schulz coefficients (a, b, c).",
                                    factory=lambda: (3.4445, -4.7750, 2.0315))
    muon_ns_dtype: str = f("auto", "Muon: dtype of the Newton-Schulz iteration: bfloat16 (as torch.optim.Muon and Moonlight), float32, or auto: bfloat16 on CUDA, float32 elsewhere (a CPU without bf16 matrix units runs the bf16 iteration ~18x slower than fp32: 1.13 s against 0.063 s per step of configs/tiny.py's 14 matrices, measured).")
    muon_rms_scale: float = f(0.2, "Muon: the update is scaled by this * sqrt(max(rows, columns)) (0.2: the RMS of AdamW's update, so AdamW's lr and weight decay carry over).")
    muon_eps: float = f(1e-7, "Muon: added to the norm the Newton-Schulz input is divided by.")
    muon_qk_clip: Optional[float] = f(None, "Muon: qk-clip threshold tau (MuonClip, Kimi-K2): after each step, every attention head whose largest pre-softmax logit in the step's forwards (maximized over the data-parallel ranks) exceeded tau has its W_q rows scaled by sqrt(tau / max), and its key head's W_k rows by the square root of the smallest such factor of the heads sharing it (biases with their rows). The logits are computed once more for the record (the attention's forward FLOPs again). None: off. Not with tensor parallel, context parallel or q/k norms.")

    def __post_init__(self) -> None:
        from .optimizer import check_optimizer
        check_optimizer(self)


@dataclass
class LRSchedulerConfig:
    """Learning-rate schedule (InternLM's `lr_scheduler`): warm-up then cosine (InternLM's), or warm-up, stable,
    decay (WSD). Either is a pure function of the step and these keys: a resumed run may change them."""

    name: str = f("cosine", "Schedule: cosine (linear warm-up, then cosine from adam.lr to eta_min at total_steps; InternLM's) or wsd (linear warm-up, adam.lr until the decay start, then decay_shape down to eta_min at total_steps).")
    total_steps: Optional[int] = f(None, "Length of the schedule; default `data.total_steps`.")
    init_steps: int = f(0, "Steps already taken before this schedule starts.")
    warmup_ratio: float = f(0.01, "Fraction of total_steps spent in linear warm-up.")
    eta_min: float = f(1e-5, "Learning rate at the end of the cosine (wsd: of the decay).")
    decay_start_step: Optional[int] = f(None, "wsd: the step the decay starts at (between the end of the warm-up and total_steps); None: total_steps - int(total_steps * decay_ratio). A job resumed with another value decays from that step on (e.g. set it to the current step to cool down now).")
    decay_ratio: float = f(0.1, "wsd: fraction of total_steps spent in the decay, when decay_start_step is None.")
    decay_shape: str = f("1-sqrt", "wsd: the decay's shape with p the fraction of the decay done: linear (1-p), cosine ((1+cos(pi p))/2) or 1-sqrt (1-sqrt(p)), times adam.lr - eta_min, plus eta_min.")
    last_epoch: int = f(-1, "Kept for InternLM compatibility (torch's last_epoch).", compat=True)

    def __post_init__(self) -> None:
        from .optimizer import check_lr_scheduler  # the rules beside the optimizer section's
        check_lr_scheduler(self)


@dataclass
class Beta2SchedulerConfig:
    """Adam beta2 schedule (InternLM's `beta2_scheduler`): beta2 = max(init_beta2, 1 - step**-c)."""

    init_beta2: Optional[float] = f(None, "Initial beta2; default `adam.adam_beta2`.")
    c: Optional[float] = f(None, "Constant c; default `adam.adam_beta2_c` (0: constant).")
    cur_iter: int = f(-1, "Starting iteration (-1: start at 0).")


@dataclass
class GradScalerConfig:
    """Dynamic loss scaling for fp16 (InternLM's `grad_scaler`)."""

    initial_scale: float = f(2.0**16, "Initial loss scale (InternLM: grad_scaler.fp16.initial_scale).")
    min_scale: float = f(1.0, "Smallest loss scale.")
    growth_interval: int = f(1000, "Grow the scale after this many steps without overflow.")
    growth_factor: float = f(2.0, "Factor to grow the scale by.")
    backoff_factor: float = f(0.5, "Factor to shrink the scale by on overflow.")
    max_scale: float = f(2.0**24, "Largest loss scale.")
    hysteresis: int = f(2, "Overflows tolerated before the scale shrinks.")


@dataclass
class HybridZeroOptimizerConfig:
    """InternLM's `hybrid_zero_optimizer`; only `clip_grad_norm` has an effect (FSDP2 does the rest)."""

    overlap_sync_grad: bool = f(True, "Kept for compatibility; FSDP2 always overlaps gradient reduction.", compat=True)
    overlap_sync_param: bool = f(True, "Kept for compatibility; FSDP2 always prefetches parameters.", compat=True)
    reduce_bucket_size: int = f(512 * 1024 * 1024, "Kept for compatibility.", compat=True)
    clip_grad_norm: float = f(1.0, "Clip the global gradient norm to this (0 or less: no clipping).")


@dataclass
class LossConfig:
    """Loss options (InternLM's `loss`)."""

    label_smoothing: float = f(0.0, "Label smoothing of the cross entropy.")
    moe_loss_coeff: float = f(0.01, "Weight of the MoE load-balancing loss (InternEvo's key); MoE families only.")
    reduction: str = f("token_mean", "What the step's loss averages (internlm_core/loss_norm.py): token_mean (the sum of the per-token losses of the whole global batch, all data-parallel ranks and micro-batches, divided by the number of its counted tokens (labels != -100): every token weighs the same whatever the packing) or micro_batch_mean (InternLM's and InternEvo's loss: the mean over the global batch's micro-batches of each one's token mean; for a run continued from theirs whose curves are compared). The families' auxiliary losses (MoE) are the same under both.")


@dataclass
class LoadCkptInfo:
    """What to load at start (InternLM's `ckpt.load_ckpt_info`)."""

    path: Optional[str] = f(None, "Checkpoint folder or URL to load.")
    content: tuple = f(None, f"What to load: any of {', '.join(CONTENTS)}, or all.", factory=lambda: ("all",))
    ckpt_type: str = f("internlm_core", "Format: internlm_core (our DCP checkpoints), internlm (InternLM's / InternEvo's own folders of model_tp{t}_pp{p}.pt; also internevo, internlm_test, internlm2_test), hf or hf_llama (a Hugging Face folder, safetensors or pytorch_model*.bin: LlamaForCausalLM, InternLMForCausalLM, InternLM2ForCausalLM, ...), llama (Meta's original Llama folder: params.json, consolidated.NN.pth; InternEvo's LLAMA; also meta). Other formats load the model only, into any layout.")
    keep_run_keys: tuple = f(None, "ckpt_type hf: config keys (model.rope_base, moe.top_k, ...) whose value in this config is kept where the folder's config.json says otherwise (continued pretraining with another rope base, say); any other key the config sets to another value than config.json is refused, and keys left at their defaults take the folder's values (README 'Hugging Face interchange').", factory=tuple)


@dataclass
class CkptConfig:
    """Checkpoint saving and loading (InternLM's `ckpt`)."""

    enable_save_ckpt: bool = f(False, "Save checkpoints.")
    save_ckpt_folder: Optional[str] = f(None, "Where to save: a local folder (optionally `local:` prefixed) or `s3://bucket/prefix`.")
    checkpoint_every: int = f(50, "Save every this many steps.")
    oss_snapshot_freq: int = f(0, "Save a snapshot every this many steps into two alternating slots (0: off).")
    load_ckpt_info: Optional[LoadCkptInfo] = f(None, "Checkpoint to load at start (see LoadCkptInfo).")
    auto_resume: bool = f(True, "Resume from the newest complete checkpoint under save_ckpt_folder (everything: model, optimizer, schedules, data position); when there is none yet (a job's first start), load_ckpt_info is loaded (a path holding nothing, such as InternLM's placeholder llm_ckpts/xxxx: fresh, with a warning), else the run starts fresh. InternLM ignored load_ckpt_info under auto_resume even then (a continued pretraining job that kept the default started from random weights). False: load_ckpt_info only, every start. InternLM's legacy load_given_ckpt=True means False.")
    async_upload: bool = f(True, "Write and upload checkpoints in the background.")
    async_upload_tmp_folder: Optional[str] = f(None, "Local staging folder for uploads to object storage.")
    stop_file_path: Optional[str] = f(None, "A file holding an integer N: save at step |N|, and stop if N > 0.")
    keep_last_k: int = f(0, "Keep only the newest k regular checkpoints (0: keep all).")
    save_at_end: bool = f(True, "Save when training finishes.")
    lease_timeout: float = f(120.0, "One live writer per save_ckpt_folder: the run that saves holds a lease (a LEASE file with a heartbeat); another run is refused at start unless the lease is older than this many seconds, its holder died on this host, or it is the same job restarted (torchrun run id, SLURM job id). 0: no lease.")
    hf_export_every: int = f(0, "Every this many steps also write a Hugging Face folder (safetensors, config.json, tokenizer files; loadable by transformers as it is) to <save_ckpt_folder>/hf/<step>/, in the background, each rank writing its own shards, with a COMPLETE marker (sizes, crc32) as the checkpoints; exports are kept. 0: off. Not with pipeline parallel.")


@dataclass
class AlertConfig:
    """Alerts (InternLM's `monitor.alert`)."""

    enable_feishu_alert: bool = f(False, "Send alerts to a Feishu webhook.")
    feishu_alert_address: Optional[str] = f(None, "Feishu webhook URL (or env INTERNLM_FEISHU_ALERT_ADDRESS).")
    light_monitor_address: Optional[str] = f(None, "InternLM's light monitor address; kept for compatibility.", compat=True)
    webhook_url: Optional[str] = f(None, "Generic JSON webhook URL (or env INTERNLM_ALERT_WEBHOOK).")
    alert_file_path: Optional[str] = f(None, "Also append alerts as JSON lines to this file.")


# monitor.trackers: the experiment trackers there are adapters for (internlm_core/monitor/trackers/, one module each)
TRACKERS = ("wandb", "mlflow")


@dataclass
class MonitorConfig:
    """Monitoring (InternLM's `monitor`)."""

    alert: AlertConfig = f(factory=AlertConfig, help="Alert destinations.")
    hang_timeout: Optional[float] = f(None, "Alert and dump stacks if no step completes within this many seconds (0: off; None: InternLM's 300 s when an alert destination is set, else off).")
    loss_spike_ratio: Optional[float] = f(None, "Alert when loss exceeds this ratio of its running average (0: off; None: InternLM's 1.5 when an alert destination is set, else off).")
    max_consecutive_inf_nan: int = f(10, "Stop after this many consecutive inf/nan steps (0: never stop).")
    log_every: int = f(1, "Console metrics line every this many steps (metrics.jsonl always gets every step).")
    tensorboard: bool = f(True, "Write TensorBoard event files into the run folder (InternEvo's dict(queue_max_length=...) means True).")
    memory_report: bool = f(False, "Write a memory report (peak per step, breakdown) into the run folder.")
    hang_action: str = f("alert", "What the hang watchdog does after hang_timeout: \"alert\" (alert, dump stacks, keep waiting) or \"exit\" (the same, then end the process with status 3 so that torchrun --max-restarts / SLURM --requeue restart the job from the newest complete checkpoint).")
    spike_rewind: bool = f(False, "Opt-in: when the loss stays above loss_spike_ratio x its running average for spike_rewind_steps steps, reload the newest complete checkpoint before the spike, skip the batches that spiked (kept in checkpoints, as data.skip_batches), alert and go on.")
    spike_rewind_steps: int = f(3, "Consecutive spiking steps that make spike_rewind rewind.")
    max_rewinds: int = f(3, "At most this many spike rewinds in a run (counted across restarts); then spikes only alert.")
    trackers: tuple = f(help="Experiment trackers that receive every metrics.jsonl record from rank 0, by name: any of "
                             "wandb (Weights & Biases; its own WANDB_* variables: WANDB_MODE, WANDB_DIR, WANDB_API_KEY, "
                             "...), mlflow (MLFLOW_TRACKING_URI, ...); each is imported only when named here. A resumed "
                             "run continues the same tracker run (its key is kept in the checkpoint); a tracker that "
                             "fails warns once and never stops training.", factory=tuple)
    tracker_project: Optional[str] = f(None, "The trackers' project (wandb) / experiment (mlflow); default JOB_NAME.")
    tracker_timeout: float = f(30.0, "Seconds a tracker may take to connect, and to send what is queued at the end.")


@dataclass
class EvaluationConfig:
    """Multiple-choice evaluation during training (not `data.valid_every`'s validation loss): log-likelihoods of
    each choice as lm-evaluation-harness computes them, from local task files."""

    tasks: list = f(help="Task files: a list of dict(name=..., path=...) where path is a .jsonl of "
                         "{\"context\": str, \"choices\": [str, ...], \"gold\": int} lines, tokenized with the "
                         "run's `tokenizer`; results eval/<name>/acc, acc_norm, loglik. Empty: no evaluation.",
                    factory=list)
    eval_every: int = f(0, "Evaluate the tasks every this many steps (0: only at the end, see at_end).")
    at_end: bool = f(True, "Evaluate the tasks once more after the last step.")
    batch_size: int = f(8, "Rows of data.seq_len tokens per evaluation forward and data-parallel rank (requests are "
                           "packed into rows, one document mask each).")
    target_delimiter: str = f(" ", "Put between the context and each choice (lm-eval's target_delimiter).")

    def __post_init__(self) -> None:
        from .evaluation import check_evaluation  # the rules beside the section's other helpers
        check_evaluation(self)


@dataclass
class Config:
    """A whole run."""

    JOB_NAME: str = f("internlm_core", "Name of the job; names the run folder and alerts.")
    model_type: str = f("INTERNLM", "Model family: INTERNLM (v1: bias on qkv/out), INTERNLM2 or LLAMA (GQA, no bias), LLAMA3, QWEN2, QWEN3, MISTRAL; mixture of experts: INTERNLM_MoE, MIXTRAL, QWEN3_MoE, DEEPSEEK_V3 (latent attention; Kimi-K2, Moonlight) (README: model families and sizes).")
    data: DataConfig = f(factory=DataConfig, help="See DataConfig.")
    model: ModelConfig = f(factory=ModelConfig, help="See ModelConfig.")
    parallel: ParallelConfig = f(factory=ParallelConfig, help="See ParallelConfig.")
    moe: MoEConfig = f(factory=MoEConfig, help="See MoEConfig.")
    adam: AdamConfig = f(factory=AdamConfig, help="See AdamConfig.")
    optimizer: OptimizerConfig = f(factory=OptimizerConfig, help="See OptimizerConfig.")
    lr_scheduler: LRSchedulerConfig = f(factory=LRSchedulerConfig, help="See LRSchedulerConfig.")
    beta2_scheduler: Beta2SchedulerConfig = f(factory=Beta2SchedulerConfig, help="See Beta2SchedulerConfig.")
    grad_scaler: GradScalerConfig = f(factory=GradScalerConfig, help="See GradScalerConfig.")
    hybrid_zero_optimizer: HybridZeroOptimizerConfig = f(factory=HybridZeroOptimizerConfig, help="See HybridZeroOptimizerConfig.")
    loss: LossConfig = f(factory=LossConfig, help="See LossConfig.")
    ckpt: CkptConfig = f(factory=CkptConfig, help="See CkptConfig.")
    monitor: MonitorConfig = f(factory=MonitorConfig, help="See MonitorConfig.")
    evaluation: EvaluationConfig = f(factory=EvaluationConfig, help="See EvaluationConfig.")
    cudnn_deterministic: bool = f(False, "Deterministic algorithms (torch.use_deterministic_algorithms) and cuDNN.")
    cudnn_benchmark: bool = f(False, "cuDNN autotuning.")
    use_fp32_norm: bool = f(False, "InternLM's top-level use_fp32_norm; same as model.use_fp32_norm.")
    seed: int = f(1024, "Seed of model init, dropout and (unless data.seed) data order.")
    DO_ALERT: bool = f(False, "InternLM's alert switch; enables monitor.alert.enable_feishu_alert.")
    tokenizer: Optional[str] = f(None, "Tokenizer of the data (model path or `byte`), recorded for export.")
    memory_check: str = f("refuse", "Before materializing, each rank's estimated peak (tools/estimate.py) against the memory free for it (CPU: available host RAM shared by the node's ranks; CUDA: the device's free memory): \"refuse\" a run that cannot fit (one line: both numbers and the nearest layouts that fit) and warn within the estimator's error (15%); \"warn\" only warns (train.py --force); \"off\" skips the check.")
    memory_limit_gib: Optional[float] = f(None, "Memory free per device for memory_check, in GiB, instead of the measured figure (pretend a smaller machine, or keep room for something else); None: measure.")
    # not a config key: which keys of the loaded file were kept for compatibility or translated (build_config sets
    # it, compat_lines logs it; a compat.CompatNotes); None for a Config made in code
    compat_notes: ClassVar[Any] = None

    def model_inputs(self) -> Any:
        """The plain values the model family reads (model.ModelInputs): its section, seq_len, the layout."""
        from ..model import ModelInputs, ParallelSizes
        p = self.parallel
        return ModelInputs(model_type=self.model_type, model=self.model, seq_len=self.data.seq_len,
                           parallel=ParallelSizes(tensor=p.tensor, pipeline=p.pipeline,
                                                  sequence_parallel=p.sequence_parallel, dims=dict(p.dims)),
                           moe=self.moe, moe_loss_coeff=self.loss.moe_loss_coeff)
