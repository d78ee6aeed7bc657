"""Analytic size, FLOPs, memory and step time of a config under a parallel layout.

Used by `train.py --dry-run` (`describe`) and `tools/estimate.py`. Everything is per device (one GPU, or one
CPU process), in bytes unless a name says otherwise.

Two precision accountings (`precision`):

internlm_core (this code base): parameters, gradients and AdamW's two moments are fp32 and FSDP2 shards all
    of them over the `zero1` group (4 + 4 + 8 bytes per parameter / shard); a bf16/fp16 run computes under
    autocast, which keeps a 16-bit copy of every weight matrix used in forward until backward (the cast is
    saved for the input gradient), so the matrices of non-recomputed layers cost 2 more bytes per parameter,
    unsharded. FSDP holds the gathered parameters of the running and the prefetched block, the gathered
    gradient of one block before its reduce-scatter, and the root's (embedding, final norm, output) all step,
    each a full-size buffer beside its shard; a pipeline stage keeps all its blocks gathered and the fp32
    reduce-scatter input of the unit it reduced last until the next micro-batch's backward.
    Gradient accumulation (numerics' Kernels.grad_reduce): sharded data parallel reduce-scatters every
    micro-batch, so only the sharded fp32 gradients accumulate; where gradients are reduced once per step
    (pipeline parallel's schedule, or `grad_reduce="step"`), FSDP keeps every parameter's gradient unsharded in
    fp32 from the first micro-batch to the last: 4 * (1 - 1/zero1) more bytes per parameter ("accumulated
    gradients"; 23.9 GiB for 7B on 8 GPUs with zero1=8).
internlm: InternLM's hybrid ZeRO-1 with bf16 parameters and gradients on every data-parallel rank (2 + 2
    bytes per parameter) and the fp32 master copy plus AdamW moments sharded over `zero1` (12 bytes /
    zero1); no weight copies (the model computes in bf16), fused RMSNorm (input saved once).

Activations are counted tensor by tensor as the backward graph of the InternLM module keeps
them (checked against `torch.autograd.graph.saved_tensors_hooks` in tests/unit/test_estimate.py):

    per layer and token, h hidden, kv key/value width, f FFN width, H heads, s seq_len, a compute bytes,
    r residual bytes (fp32 under autocast):
      2 RMSNorms         2 * (n * r * h + 8)       n = 1 (CUDA's fused RMSNorm, InternLM's apex norm: the
                                                   input), 2 on CPU (torch's composite: input and normalized)
      linear inputs      k * a * h                 k = 5 under autocast (q, k, v, w1, w2 each cast their
                                                   input), 2 when the compute dtype is the parameter dtype
      attention          a * (2h + 2kv) + 4H       q, k, v, output, log-sum-exp (flash-attn, SDPA)
      document mask      a * s                     SDPA with a packed-document mask only (not flash-attn)
      cpu_blocked        a * (2h + 2kv) + p * H * w  CPU (`blocked_causal_attention`): q, k, v, output and the
                                                   probabilities, w keys per query on average (about s/2 + s/8
                                                   for blocks of s/4), p = 4 (fp32 softmax) + 2 under bf16
                                                   autocast (their 16-bit copy); packed documents add one
                                                   bool block mask, w bytes per token, shared by all layers
      SwiGLU FFN         4 * a * f                 w1 x, silu(w1 x), w2 x, their product
    a recomputed (checkpointed) layer keeps only its input (r * h), and one layer's worth is rebuilt at a
    time in backward. Head (last pipeline stage), per token: the final norm, the output layer's input, the
    logits (a * V, held by the trainer through backward) and what the cross entropy kernel keeps: torch's
    (and vocab_parallel's) fp32 log-softmax (4V), with two more fp32 V-wide buffers in its backward; the fused
    chunked kernel's precomputed gradient (a * V), scaled in place in backward; flash-attn's nothing (its
    backward overwrites the logits). Tensor parallel divides head- and FFN-sharded activations
    and vocabulary-wide ones by tp (norm-side ones too with sequence parallel). Pipeline: a stage holds
    L / pp layers and, under 1F1B, up to min(pp, micro_num) micro-batches in flight (the first stage).

Time per step = (model FLOPs of one step) / (devices * MFU * peak FLOP/s); MFU counts model FLOPs
(6N + 12*L*h*s per token, no recomputation), as the throughput metric of the trainer does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .config import Config
from .model import ModelArgs, analytic_parameter_count, flops_per_token
from .model.layers import cpu_half_gemm_upcast
from .numerics.kernels import select_attention, select_cross_entropy, select_grad_reduce
from .numerics.precision import resolve_precision
from .utils.accelerators import WORKING

GiB = 1024**3
PRECISIONS = ("internlm_core", "internlm")
DEFAULT_PEAK_TFLOPS = 989.0   # H100/H200 SXM dense bf16
DEFAULT_MFU = 0.5


@dataclass
class Layout:
    """How the devices split the work: world = dp * tp * pp; zero1 shards within dp."""

    world_size: int
    tp: int
    pp: int
    dp: int
    dp_shard: int
    num_chunks: int
    sequence_parallel: bool

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> "Layout":
        p = cfg.parallel
        dp = max(world_size // (p.tensor * p.pipeline), 1)
        shard = dp if p.zero1 <= 0 else 1 if p.zero1 == 1 else min(p.zero1, dp)
        return cls(world_size, p.tensor, p.pipeline, dp, shard, cfg.model.num_chunks, p.sequence_parallel)

    def describe(self) -> str:
        rep = self.dp // self.dp_shard
        zero = (f"zero1 shard {self.dp_shard}" + (f" x replicate {rep}" if rep > 1 else "")) if self.dp_shard > 1 \
            else "no zero1 sharding"
        return (f"{self.world_size} device(s): data {self.dp} ({zero}), tensor {self.tp}"
                f"{' + sequence parallel' if self.sequence_parallel else ''}, pipeline {self.pp}"
                f"{f' x {self.num_chunks} chunks' if self.num_chunks > 1 else ''}")


@dataclass
class Memory:
    """Peak bytes on the busiest device, by what holds them."""

    parameters: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    weight_copies: float = 0.0   # 16-bit casts saved by autocast for backward
    fsdp_gathered: float = 0.0   # unsharded parameters / gradients FSDP holds at the peak
    accumulated_gradients: float = 0.0  # unsharded fp32 gradients kept between micro-batches (beyond the shard)
    activations: float = 0.0     # tensors saved for backward (all layers, in-flight micro-batches)
    loss_peak: float = 0.0       # transient buffers of the loss backward (logits gradient)
    gemm_copies: float = 0.0     # CPU without native 16-bit GEMM: fp32 operands of the largest linear's backward
    root_reduce: float = 0.0     # FSDP: the end of backward (the root's gradients reduced) above the peak before it
    runtime: float = 0.0         # CPU: the process itself (Python, torch, the data pipeline), as measured
    stage: str = ""

    ORDER = ("parameters", "gradients", "optimizer", "weight_copies", "fsdp_gathered", "accumulated_gradients",
             "activations", "loss_peak", "gemm_copies", "root_reduce", "runtime")
    LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer state",
              "weight_copies": "16-bit weight copies", "fsdp_gathered": "FSDP gathered",
              "accumulated_gradients": "accumulated gradients", "activations": "activations",
              "loss_peak": "loss backward peak", "gemm_copies": "fp32 GEMM copies (CPU)",
              "root_reduce": "root gradient reduce", "runtime": "process itself (CPU)"}

    @property
    def states(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return sum(getattr(self, k) for k in self.ORDER)


@dataclass
class Communication:
    """FSDP's collectives on one rank (of the stage the memory figures are for) per training step, as
    parallel.CommCounter counts them: the all-gathers' output bytes (unsharded weights in the gathered dtype) and
    the reduce-scatters' input bytes (unsharded fp32 gradients). 0 without sharded data parallel."""

    gathered_bytes: float = 0.0
    reduced_bytes: float = 0.0
    gathers: int = 0
    reduces: int = 0


@dataclass
class Estimate:
    cfg: Config
    layout: Layout
    precision: str
    attention: str
    cross_entropy: str
    grad_reduce: str
    parameters: int
    nonembedding_parameters: int
    model_flops_per_token: float
    hardware_flops_per_token: float
    tokens_per_step: int
    memory: Memory
    mfu: float
    peak_flops: float
    device_memory: Optional[float] = None
    notes: list = field(default_factory=list)
    communication: Communication = field(default_factory=Communication)

    @property
    def step_time(self) -> float:
        return self.tokens_per_step * self.model_flops_per_token / (self.layout.world_size * self.mfu * self.peak_flops)

    @property
    def tokens_per_device_per_second(self) -> float:
        return self.tokens_per_step / self.layout.world_size / self.step_time


def keys_per_query(seq_len: int) -> float:
    """Mean number of keys a query of `blocked_causal_attention` scores (whole diagonal blocks included)."""
    from .model.attention import CAUSAL_BLOCK
    return sum((min(s + CAUSAL_BLOCK, seq_len) - s) * min(s + CAUSAL_BLOCK, seq_len)
               for s in range(0, seq_len, CAUSAL_BLOCK)) / seq_len


def _bytes_per_token_per_layer(a: ModelArgs, seq_len: int, comp: int, resid: int, norm_tensors: int,
                               linear_inputs: int, attention: str, mask: bool, tp: int, sp: bool) -> float:
    h, kv, f, H = a.hidden_size, a.num_kv_heads * a.head_dim, a.ffn_width, a.num_heads
    norm_side = 2 * (norm_tensors * resid * h + 8) + linear_inputs * comp * h
    if attention == "cpu_blocked":
        probs = (4 + (2 if comp == 2 else 0)) * H * keys_per_query(seq_len)
    else:
        probs = 4 * H  # the log-sum-exp
    sharded = comp * (2 * h + 2 * kv) + probs + 4 * comp * f
    return norm_side / (tp if sp else 1) + sharded / tp + (comp * seq_len if mask else 0)


def estimate(cfg: Config, world_size: int = 1, precision: str = "internlm_core", mfu: float = DEFAULT_MFU,
             peak_tflops: float = DEFAULT_PEAK_TFLOPS, attention: Optional[str] = None,
             device_memory_gib: Optional[float] = None, args: Optional[ModelArgs] = None,
             device: str = "cuda", grad_reduce: Optional[str] = None, pipeline_rank: Optional[int] = None,
             runtime_bytes: float = 0.0) -> Estimate:
    """The figures of `cfg` on `world_size` devices of type `device` ("cuda" or "cpu").

    The kernels are those numerics.select_kernels would choose on such devices with requirements-gpu.txt
    installed and working (flash-attn on CUDA for 16-bit compute, cpu_blocked on CPU, ...). attention: override
    with "flash" (no mask), "sdpa" (a packed-document mask) or "cpu_blocked" (probabilities kept). grad_reduce:
    override when FSDP reduces gradients, "micro_batch" or "step" (which keeps them unsharded in between).
    pipeline_rank: the memory of that pipeline stage instead of the busiest one. runtime_bytes: what the process
    holds before the model (CPU: its resident memory, which the peak of a CPU run counts; a CUDA allocator's peak
    does not count it, so it is ignored there).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {PRECISIONS}")
    if args is None:
        from .model import model_args_from_config
        args = model_args_from_config(cfg, "cuda")
    m, d = cfg.model, cfg.data
    lay = Layout.from_config(cfg, world_size)
    numerics = resolve_precision(m.dtype, device)
    if attention is None:
        attention = select_attention(m.attn_backend, m.use_flash_attn, numerics, device, WORKING, [], {})
    cross_entropy = select_cross_entropy(device, cfg.loss.label_smoothing, lay.tp > 1 and m.parallel_output,
                                         m.compile, WORKING, [], {})
    if grad_reduce is None:
        grad_reduce = select_grad_reduce(lay.dp, lay.dp_shard, lay.pp, d.micro_num, [])
    mask = attention == "sdpa" and not d.pack_sample_into_one
    comp = numerics.compute_dtype.itemsize
    h, V, L = args.hidden_size, args.vocab_size, args.num_layers
    kv = args.num_kv_heads * args.head_dim
    tokens_mb = d.micro_bsz * d.seq_len  # tokens of one micro-batch on one dp rank

    # parameters of one layer, of the embedding, of the head (final norm + output)
    layer_matrices = 2 * h * h + 2 * h * kv + 3 * h * args.ffn_width
    layer_params = layer_matrices + 2 * h + ((2 * h + 2 * kv) if args.qkv_bias else 0)
    embed = V * h
    head = h + (0 if args.tie_word_embeddings else V * h)
    total = analytic_parameter_count(args)

    L_stage = L // lay.pp
    frac = 1.0 if m.checkpoint is True else 0.0 if m.checkpoint is False else float(m.checkpoint)
    n_ckpt = round(frac * L_stage)
    in_flight = min(lay.pp, d.micro_num) if lay.pp > 1 else 1
    if lay.pp > 1 and lay.num_chunks > 1:
        in_flight *= 1 + (lay.pp - 1) / (lay.pp * lay.num_chunks)

    autocast = precision == "internlm_core" and comp == 2
    resid = 4 if precision == "internlm_core" else comp
    # torch's RMSNorm keeps input and normalized output on CPU (composite), the input only on CUDA (fused kernel)
    norm_tensors = 2 if (precision == "internlm_core" and device == "cpu") else 1
    linear_inputs = 5 if autocast else 2
    per_layer_tok = _bytes_per_token_per_layer(args, d.seq_len, comp, resid, norm_tensors, linear_inputs, attention,
                                               mask, lay.tp, lay.sequence_parallel)
    ckpt_layer_tok = resid * h / (lay.tp if lay.sequence_parallel else 1)
    doc_masks = attention == "cpu_blocked" and not d.pack_sample_into_one  # packed documents: the block masks
    # token ids, rotary cos/sin, bool document mask
    shared_tok = 8 + 8 * args.head_dim + (d.seq_len if mask else keys_per_query(d.seq_len) if doc_masks else 0)
    layers_act = (L_stage - n_ckpt) * per_layer_tok + n_ckpt * ckpt_layer_tok + (per_layer_tok if n_ckpt else 0)
    first_stage_act = tokens_mb * in_flight * (layers_act + shared_tok)
    # the cross entropy: torch's keeps the fp32 log-softmax (4V) and needs 8V more in backward; the fused kernel
    # keeps its precomputed gradient (a*V), scaled in place (fp32 under a factor other than 1: a new a*V);
    # flash-attn's keeps nothing (its in-place backward overwrites the logits)
    fused = cross_entropy.startswith("fused")
    ce_kept = 0 if cross_entropy == "flash" else comp * V if fused else 4 * V
    head_tok = (norm_tensors * resid * h + 8) / (lay.tp if lay.sequence_parallel else 1) + comp * h \
        + (comp * V + ce_kept) / lay.tp
    last_stage_act = tokens_mb * (layers_act + shared_tok + head_tok)
    ce_peak = 8 * V if cross_entropy in ("torch", "vocab_parallel") else \
        comp * V if fused and comp == 4 and d.micro_num > 1 else 0
    loss_peak = tokens_mb * ce_peak / lay.tp
    keeps_unsharded = precision == "internlm_core" and grad_reduce == "step" and lay.dp_shard > 1 and d.micro_num > 1
    # a CPU without native 16-bit GEMM (this machine's, for device "cpu") multiplies 16-bit linear layers in fp32
    # (model/layers.py HalfLinearFp32Gemm): the backward of the largest linear holds fp32 copies of its weight, its
    # output gradient, its input and the weight gradient (4 * (2 o i + t (o + i)) bytes)
    upcast = device == "cpu" and comp == 2 and cpu_half_gemm_upcast(numerics.compute_dtype)

    def gemm_copies(out_dim: float, in_dim: float) -> float:
        return 4 * (2 * out_dim * in_dim + tokens_mb * (out_dim + in_dim)) if upcast else 0.0

    def stage_memory(params_here: float, act: float, with_head: bool, name: str, warmup: int = 0) -> Memory:
        """warmup: the forwards a pipeline stage runs before its first backward (1F1B); when that is every
        micro-batch, the peak (all of them in flight) comes before any gradient of the step exists."""
        mem = Memory(stage=name)
        per_tp = params_here / lay.tp
        forward_first = lay.pp > 1 and lay.num_chunks == 1 and d.micro_num <= warmup
        if precision == "internlm_core":
            mem.parameters = 4 * per_tp / lay.dp_shard
            mem.gradients = 0.0 if forward_first else 4 * per_tp / lay.dp_shard
            mem.optimizer = 8 * per_tp / lay.dp_shard
            # FSDP's mixed precision (any data parallel) gathers 16-bit weights: autocast copies none of them
            fsdp_mp = autocast and lay.dp > 1
            if autocast and not fsdp_mp:
                copies = (L_stage - n_ckpt + (1 if n_ckpt else 0)) * layer_matrices
                copies += (V * h) if with_head else 0
                mem.weight_copies = 2 * copies / lay.tp
            if lay.dp_shard > 1:
                # gathered tensors are new full-size buffers, beside the shards (counted in parameters)
                root = (embed if name in ("all", "first") else 0) + (head if with_head else 0)
                w = comp if fsdp_mp else 4  # bytes of a gathered weight
                if lay.pp > 1:
                    # blocks stay gathered between micro-batches; the schedule's backwards are not the last
                    # (set_is_last_backward(False)), so FSDP keeps the fp32 reduce-scatter input of the unit it
                    # reduced last (the root, or the stage's first block) until the next micro-batch's backward.
                    # In 1F1B's steady state a forward gathers a block again while the other micro-batches are
                    # in flight: the all-gather's output and the unsharded parameters it is copied into coexist
                    # (a second copy of the unit). A stage that runs every forward first has no such moment.
                    kept_input = 0 if forward_first else 4 * (root or layer_params)
                    regather = 0 if forward_first else w * max(layer_params, root)
                    gathered = w * (L_stage * layer_params + root) + kept_input + regather
                else:  # the running and the prefetched block, the root, one block's unsharded fp32 gradient
                    gathered = w * (2 * layer_params + root) + 4 * layer_params
                mem.fsdp_gathered = gathered / lay.tp
            if keeps_unsharded:  # every gradient unsharded in fp32 until the last micro-batch's reduction
                mem.accumulated_gradients = 4 * per_tp * (1 - 1 / lay.dp_shard)
        else:
            mem.parameters = 2 * per_tp
            mem.gradients = 2 * per_tp
            mem.optimizer = 12 * per_tp / lay.dp_shard
        mem.activations = act
        mem.loss_peak = loss_peak if with_head else 0.0
        # the output layer's backward follows the loss backward, whose transients are gone by then: only the
        # excess over them adds to the peak
        ffn = gemm_copies(args.ffn_width / lay.tp, h)
        mem.gemm_copies = max(ffn, gemm_copies(V / lay.tp, h) - mem.loss_peak) if with_head else ffn
        if precision == "internlm_core" and lay.dp_shard > 1:
            # The root (embedding; final norm and output) is reduced last, when a backward ends: its gathered
            # weights, the output layer's and the embedding's gradients (the output's from the start of
            # backward) and FSDP's fp32 reduce-scatter copy, while the stage's blocks are resharded and only the
            # other micro-batches in flight keep activations. Where that exceeds the peak counted above, the
            # excess adds (measured in the simulated stage, tests/e2e/test_simulate.py).
            g = comp if fsdp_mp else 4
            emb_here, head_here = (embed if name in ("all", "first") else 0), (head if with_head else 0)
            flight = min(warmup, d.micro_num) if lay.pp > 1 else 1
            at_reduce = (w + g + 4) * (emb_here + head_here) / lay.tp + act * (flight - 1) / flight \
                + (4 * per_tp / lay.dp_shard if forward_first else 0)  # the step's first gradients exist by then
            before = mem.fsdp_gathered + mem.activations + mem.loss_peak + mem.gemm_copies
            mem.root_reduce = max(0.0, at_reduce - before) if emb_here or head_here else 0.0
        return mem

    stage_layer_params = L_stage * layer_params
    if pipeline_rank is not None and not 0 <= pipeline_rank < lay.pp:
        raise ValueError(f"pipeline_rank {pipeline_rank}: expected 0 <= rank < {lay.pp}")
    if lay.pp == 1:
        mem = stage_memory(total, last_stage_act, True, "all")
    elif pipeline_rank is not None and 0 < pipeline_rank < lay.pp - 1:
        # a middle stage: its layers only, with (pp - rank) micro-batches in flight under 1F1B
        flight = min(lay.pp - pipeline_rank, d.micro_num) * in_flight / min(lay.pp, d.micro_num)
        mem = stage_memory(stage_layer_params, tokens_mb * flight * (layers_act + shared_tok), False, "middle",
                           warmup=lay.pp - pipeline_rank)
    else:
        first = stage_memory(stage_layer_params + embed, first_stage_act, False, "first", warmup=lay.pp)
        last = stage_memory(stage_layer_params + head, last_stage_act, True, "last", warmup=1)
        mem = first if pipeline_rank == 0 else last if pipeline_rank == lay.pp - 1 else \
            max((first, last), key=lambda x: x.total)
    if device == "cpu":
        mem.runtime = float(runtime_bytes)

    model_fpt = float(flops_per_token(args, d.seq_len))
    n_ckpt_total = round(frac * L_stage) * lay.pp
    hw_fpt = model_fpt + n_ckpt_total * (2 * layer_matrices + 4 * h * d.seq_len)
    notes = []
    if precision == "internlm_core":
        notes.append("precision internlm_core: fp32 parameters, gradients and AdamW moments (16 B/parameter) "
                     f"sharded over zero1 ({lay.dp_shard}); "
                     + (f"FSDP gathers {m.dtype.split('.')[-1]} weights (no autocast copies)" if autocast and lay.dp > 1
                        else f"{m.dtype.split('.')[-1]} autocast keeps 16-bit weight copies of non-recomputed layers"
                        if autocast else "fp32 compute"))
    else:
        notes.append(f"precision internlm: bf16 parameters + gradients on every rank (4 B/parameter), fp32 master "
                     f"weights + AdamW moments (12 B/parameter) sharded over zero1 ({lay.dp_shard})")
    notes.append(f"attention {attention}" + (" with a packed-document mask per layer (a*s bytes per token)" if mask
                                             else " (probabilities kept for backward)" if attention == "cpu_blocked"
                                             else " (no attention matrix kept)") + f"; cross entropy {cross_entropy}")
    if precision == "internlm_core" and lay.dp_shard > 1 and d.micro_num > 1:
        if grad_reduce == "micro_batch":
            kept = 4 * total / lay.tp * (1 - 1 / lay.dp_shard)
            notes.append(f"gradient accumulation: reduce-scatter after each of the {d.micro_num} micro-batches, so only "
                         f"the sharded fp32 gradients accumulate; reducing once per step would keep them unsharded, "
                         f"{kept / GiB:.1f} GiB more (--grad-reduce step)")
        else:
            notes.append(f"gradient accumulation: reduced once per step, every gradient stays unsharded in fp32 over "
                         f"the {d.micro_num} micro-batches ({mem.accumulated_gradients / GiB:.1f} GiB beyond the shard)")
    if n_ckpt:
        notes.append(f"activation checkpointing: {n_ckpt} of {L_stage} layers per stage keep only their input")
    if lay.pp > 1 and mem.gradients == 0 and precision == "internlm_core":
        notes.append(f"pipeline stage '{mem.stage}' runs all {d.micro_num} forwards before its first backward: its "
                     f"peak comes before the step's gradients exist (they are not counted)")
    if lay.pp > 1:
        which = f"stage {pipeline_rank} ('{mem.stage}')" if pipeline_rank is not None else f"busiest stage '{mem.stage}'"
        notes.append(f"pipeline: {which}, {in_flight:g} micro-batch(es) in flight on the first")
    comm = fsdp_communication(lay, d.micro_num, grad_reduce, mem.stage, L_stage, layer_params, embed, head,
                              comp if (autocast and lay.dp > 1) else 4) \
        if precision == "internlm_core" else Communication()
    if comm.gathers:
        notes.append(f"FSDP per step: {comm.gathered_bytes / GiB:.2f} GiB gathered in {comm.gathers} all-gathers, "
                     f"{comm.reduced_bytes / GiB:.2f} GiB reduced in {comm.reduces} reduce-scatters (the collectives' "
                     f"sizes; (n-1)/n of them cross the wire; comm/* metrics measure them)")
    return Estimate(cfg=cfg, layout=lay, precision=precision, attention=attention, cross_entropy=cross_entropy,
                    grad_reduce=grad_reduce, parameters=total,
                    nonembedding_parameters=total - embed, model_flops_per_token=model_fpt,
                    hardware_flops_per_token=hw_fpt, tokens_per_step=tokens_mb * d.micro_num * lay.dp,
                    memory=mem, mfu=mfu, peak_flops=peak_tflops * 1e12,
                    device_memory=device_memory_gib * GiB if device_memory_gib else None, notes=notes,
                    communication=comm)


def fsdp_communication(lay: Layout, micro_num: int, grad_reduce: str, stage: str, layers: int, layer_params: float,
                       embed: float, head: float, gathered_itemsize: int) -> Communication:
    """FSDP's all-gathers and reduce-scatters per step on a rank of `stage` ("all" without pipeline parallel).

    FSDP units: every block, and the root (what the blocks leave: embedding, final norm, output), each
    `1 / tensor` of its parameters on a tensor-parallel rank. Without pipeline parallel a block is gathered for
    its forward and again for its backward (it reshards after forward) and the root once, every micro-batch.
    Under 1F1B a stage keeps its blocks gathered from a forward to the next backward and reshards after each
    backward: one gather per micro-batch. Reduce-scatters: every unit every micro-batch ("micro_batch") or
    once per step ("step"), in fp32. These are a steady step's figures: a pipeline's first step adds the
    schedule's shape-inference forward, and a step after a validation finds the weights the validation left
    gathered (measured in tests/dist/test_parallel.py).
    """
    out = Communication()
    if lay.dp_shard <= 1:
        return out
    root = (embed if stage in ("all", "first") else 0.0) + (head if stage in ("all", "last") else 0.0)
    units = [(layer_params / lay.tp, 2 if lay.pp == 1 else 1)] * layers
    if root:
        units.append((root / lay.tp, 1))
    reduces_each = micro_num if grad_reduce == "micro_batch" else 1
    for params, gathers in units:
        out.gathers += gathers * micro_num
        out.gathered_bytes += gathers * micro_num * params * gathered_itemsize
        out.reduces += reduces_each
        out.reduced_bytes += reduces_each * params * 4
    return out


def format_estimate(e: Estimate, other: Optional[Estimate] = None) -> str:
    """The human-readable report; `other` (the other precision) adds a one-line comparison."""
    cfg, lay, mem = e.cfg, e.layout, e.memory
    d = cfg.data
    lines = [
        f"model {cfg.model_type}: {e.parameters:,} parameters ({e.parameters / 1e9:.3f} B; "
        f"{e.nonembedding_parameters / 1e9:.3f} B without the input embedding)",
        f"FLOPs per token: {e.model_flops_per_token / 1e9:.2f} GFLOP model (6N + 12*L*h*s, s={d.seq_len})"
        + (f", {e.hardware_flops_per_token / 1e9:.2f} GFLOP with recomputation"
           if e.hardware_flops_per_token != e.model_flops_per_token else ""),
        f"layout: {lay.describe()}",
        f"batch: micro_bsz {d.micro_bsz} x seq_len {d.seq_len} x micro_num {d.micro_num} x dp {lay.dp} = "
        f"{e.tokens_per_step:,} tokens per step",
        f"memory per device ({cfg.model.dtype.split('.')[-1]}, precision {e.precision}"
        + (f", stage {mem.stage}" if lay.pp > 1 else "") + "):",
    ]
    accumulating = e.precision == "internlm_core" and lay.dp_shard > 1 and d.micro_num > 1
    for k in Memory.ORDER:
        v = getattr(mem, k)
        if v or k in ("parameters", "gradients", "optimizer", "activations") or \
                (k == "accumulated_gradients" and accumulating):
            why = {"micro_batch": "  (0: reduce-scattered every micro-batch)",
                   "step": "  (unsharded fp32 until the last micro-batch)"}[e.grad_reduce] \
                if k == "accumulated_gradients" else ""
            lines.append(f"  {Memory.LABELS[k]:<22} {v / GiB:9.2f} GiB{why}")
    fits = ""
    if e.device_memory:
        fits = (f"  (fits in {e.device_memory / GiB:g} GiB)" if mem.total <= e.device_memory
                else f"  (does NOT fit in {e.device_memory / GiB:g} GiB)")
    lines.append(f"  {'total (peak)':<22} {mem.total / GiB:9.2f} GiB{fits}")
    if other is not None:
        lines.append(f"  (precision {other.precision}: {other.memory.total / GiB:.2f} GiB; states "
                     f"{other.memory.states / GiB:.2f} GiB)")
    lines.append(f"time per step at MFU {e.mfu:.0%} of {e.peak_flops / 1e12:g} TFLOP/s: {e.step_time:.2f} s "
                 f"({e.tokens_per_device_per_second:,.0f} tokens per device per second)")
    lines += [f"note: {n}" for n in e.notes]
    return "\n".join(lines)


def memory_per_device(cfg: Config, args: ModelArgs, world_size: int = 1) -> dict[str, float]:
    """Bytes per device for parameters, gradients and optimizer state (this code base's precision)."""
    mem = estimate(cfg, world_size, args=args).memory
    return {"parameters": mem.parameters, "gradients": mem.gradients, "optimizer": mem.optimizer}


def describe(cfg: Config, args: ModelArgs, world_size: int = 1) -> str:
    """Human-readable summary for `train.py --dry-run`: size, FLOPs per token, memory per device, step time."""
    return format_estimate(estimate(cfg, world_size, args=args))
