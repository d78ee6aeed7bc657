"""`estimate`: the figures of a config under a parallel layout, from the family's counts and the run's kernels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..config import Config
from ..config.pipeline import SPLIT_BACKWARD, V_SHAPED
from ..config.recompute import checkpoint_plan, fused_head_of
from ..model import get_model_spec, model_args_from_config
from ..model.counts import ActivationContext
from ..numerics.kernels import (LINEAR, select_attention, select_cross_entropy, select_grad_reduce,
                                select_linear)
from ..numerics.precision import resolve_precision
from ..utils import cpu_features
from ..utils.accelerators import WORKING
from ..utils.cpu_features import CpuFeatures
from .activations import (StageActivations, TokenBytes, fused_forward_chunks, fused_head_transients,
                          stage_activations, token_bytes)
from .communication import fsdp_communication
from .fused_choice import pick_fused_head, with_fused_head
from .figures import (DEFAULT_MFU, DEFAULT_PEAK_TFLOPS, GiB, PRECISIONS, Communication, Estimate, Layout,
                      cuda_runtime_bytes)
from .memory import StageContext, pick_stage
from .lowp import apply_low_precision
from .terms import ModelFigures, divisor


@dataclass(frozen=True)
class Kernels:
    """The kernels the estimate assumes (numerics.select_kernels' choices on such devices, or overrides)."""

    attention: str
    cross_entropy: str
    grad_reduce: str
    linear: str


def choose_kernels(cfg: Config, lay: Layout, numerics: Any, device: str, attention: Optional[str],
                   grad_reduce: Optional[str], linear: Optional[str], cpu: Optional[CpuFeatures] = None) -> Kernels:
    """select_kernels' choices where no override is given; `cpu`: the CPU's features (default
    utils.cpu_features.current(): this machine's, unless pinned)."""
    m, d = cfg.model, cfg.data
    if attention is None:
        attention = select_attention(m.attn_backend, m.use_flash_attn, numerics, device, WORKING, [], {})
    cross_entropy = select_cross_entropy(device, cfg.loss.label_smoothing, lay.tp > 1 and m.parallel_output,
                                         m.compile, WORKING, [], {})
    if fused_head_of(cfg):  # model.fused_head_loss: the head and the loss together, no logits
        cross_entropy = "fused_head"
    if grad_reduce is None:
        grad_reduce = select_grad_reduce(lay.dp, lay.dp_shard, lay.pp, d.micro_num, [])
        if lay.pp > 1 and lay.pipeline_schedule in SPLIT_BACKWARD:  # parallel/pipeline.py: reduced once per step
            grad_reduce = "step"
    if linear is None:
        feats = (cpu or cpu_features.current()) if device == "cpu" else CpuFeatures()
        linear = select_linear(device, numerics, feats.onednn_linear, feats.native_half_gemm)
    elif linear not in LINEAR:
        raise ValueError(f"linear {linear!r}: expected one of {', '.join(LINEAR)}")
    return Kernels(attention, cross_entropy, grad_reduce, linear)


def checkpointed_blocks(cfg: Config, layers: int) -> tuple[str, int]:
    """(policy, how many of a stage's `layers` are recomputed) of model.checkpoint (parallel/activation_checkpoint:
    the first round(fraction * layers) blocks, whole under "full", per operator under "selective")."""
    policy, fraction = checkpoint_plan(cfg.model.checkpoint)
    return policy, round(fraction * layers)


def stage_context(cfg: Config, lay: Layout, figures: ModelFigures, precision: str, comp: int, k: Kernels,
                  tb: TokenBytes, loss_forward: float, acts: StageActivations) -> StageContext:
    """loss_forward: the loss forward's transient buffers (its backward's are per token in `tb`); the larger
    of the two is the loss's peak."""
    d = cfg.data
    layers = cfg.model.num_layers // lay.pp
    autocast = precision == "internlm_core" and comp == 2
    tokens = d.micro_bsz * d.seq_len // lay.cp  # this rank's zigzag chunk under context parallel
    _, checkpointed = checkpointed_blocks(cfg, layers)
    loss_peak = max(tokens * tb.loss_peak, loss_forward)
    return StageContext(
        lay=lay, precision=precision, autocast=autocast, comp=comp, micro_num=d.micro_num, layers=layers,
        checkpointed=checkpointed,
        keeps_unsharded=precision == "internlm_core" and k.grad_reduce == "step" and lay.dp_shard > 1
        and d.micro_num > 1,
        fp32_gemm=k.linear == "fp32_gemm", cached_casts=autocast and k.linear != "fp32_gemm",
        tokens=tokens, loss_peak=loss_peak, logits=tokens * tb.logits,
        recomputed=acts.rebuilt_excess(loss_peak), head_activations=tokens * tb.head, figures=figures)


def activation_context(cfg: Config, lay: Layout, precision: str, comp: int, device: str, attention: str
                       ) -> ActivationContext:
    """The dtypes a block's saved tensors have, by numerics/precision.py's policy. This code base ("internlm_core"):
    under FSDP (data x context parallel > 1) its policy gathers 16-bit parameters and autocast is off, so the
    residual stream and every linear input are in the compute dtype (no casts); without FSDP the parameters stay
    fp32 and the residual stream with them, and autocast casts each linear's input. "internlm": InternLM's own
    bf16 model (no autocast)."""
    fsdp = lay.dp > 1  # parallel/dtype_policy.fsdp_wraps: dp here counts the context ranks too
    ours = precision == "internlm_core"
    return ActivationContext(seq_len=cfg.data.seq_len, compute_bytes=comp,
                             residual_bytes=4 if ours and not fsdp else comp,
                             # torch's RMSNorm keeps input and normalized output on CPU (composite), the input
                             # only on CUDA (fused kernel, InternLM's apex norm)
                             norm_tensors=2 if (ours and device == "cpu") else 1,
                             autocast=ours and comp == 2 and not fsdp,
                             # context parallel: model/context's blockwise core keeps what flash-attn keeps (q, k,
                             # v, output, log-sum-exp) and no mask; its per-block transients are small
                             attention="flash" if lay.cp > 1 else attention,
                             packed_documents=not cfg.data.pack_sample_into_one, repeat_kv=device == "cuda",
                             norm_bytes=4 if ours and device == "cpu" else None)


def estimate(cfg: Config, world_size: int = 1, precision: str = "internlm_core", mfu: float = DEFAULT_MFU,
             peak_tflops: float = DEFAULT_PEAK_TFLOPS, attention: Optional[str] = None,
             device_memory_gib: Optional[float] = None, args: Optional[Any] = None,
             device: str = "cuda", grad_reduce: Optional[str] = None, pipeline_rank: Optional[int] = None,
             runtime_bytes: float = 0.0, linear: Optional[str] = None, cpu: Optional[CpuFeatures] = None) -> Estimate:
    """The figures of `cfg` on `world_size` devices of type `device` ("cuda" or "cpu").

    The kernels are those numerics.select_kernels would choose on such devices with requirements-gpu.txt
    installed and working (flash-attn on CUDA for 16-bit compute, cpu_blocked on CPU, ...). attention: override
    with "flash" (no mask), "sdpa" (a packed-document mask) or "cpu_blocked" (probabilities kept). grad_reduce:
    override when FSDP reduces gradients, "micro_batch" or "step" (which keeps them unsharded in between).
    linear: override the linear kernel: "fp32_gemm" (a CPU without native 16-bit GEMM: the casts it saves, the
    fp32 copies of its backward) or "onednn" / "torch" (autocast's cached casts); default this machine's choice
    for device "cpu" (numerics.select_linear of `cpu`'s native_half_gemm), "torch" for "cuda". cpu: the CPU's
    features (utils/cpu_features.py; default current(): this machine's, unless pinned).
    pipeline_rank: the memory of that pipeline stage instead of the busiest one. runtime_bytes: what the process
    holds before the model (CPU: its resident memory, which the peak of a CPU run counts; a CUDA allocator's peak
    does not count it, so it is ignored there).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {PRECISIONS}")
    if cfg.model.fused_head_loss == "auto" and fused_head_of(cfg, auto=True):  # decided here (fused_choice.py)
        kw = dict(world_size=world_size, precision=precision, mfu=mfu, peak_tflops=peak_tflops, attention=attention,
                  device_memory_gib=device_memory_gib, args=args, device=device, grad_reduce=grad_reduce,
                  pipeline_rank=pipeline_rank, runtime_bytes=runtime_bytes, linear=linear, cpu=cpu)
        return pick_fused_head(estimate(with_fused_head(cfg, True), **kw), estimate(with_fused_head(cfg, False), **kw))
    spec = get_model_spec(cfg.model_type)
    args = args if args is not None else model_args_from_config(cfg, "cuda")
    d = cfg.data
    lay = Layout.from_config(cfg, world_size, spec.plan)
    numerics = resolve_precision(cfg.model.dtype, device)
    k = choose_kernels(cfg, lay, numerics, device, attention, grad_reduce, linear, cpu)
    comp = numerics.compute_dtype.itemsize
    figures = ModelFigures.resolve(spec, args, lay, d.seq_len)
    ctx = activation_context(cfg, lay, precision, comp, device, k.attention)
    tb = token_bytes(figures, args, ctx, lay, k.cross_entropy, d.micro_num)
    tokens = d.micro_bsz * d.seq_len // lay.cp
    vocab = figures.counts.logits(args)
    local_vocab = vocab.value / divisor(vocab.shard, lay.sizes)
    weight_itemsize = comp if precision == "internlm_core" and comp == 2 and lay.dp > 1 else 4  # FSDP's gathers
    policy, checkpointed = checkpointed_blocks(cfg, cfg.model.num_layers // lay.pp)
    acts = stage_activations(tb, lay, cfg.model.num_layers // lay.pp, checkpointed, d.micro_num, tokens,
                             cfg.model.offload_activations, policy)
    c = stage_context(cfg, lay, figures, precision, comp, k, tb, fused_head_transients(
        local_vocab, cfg.model.hidden_size, tokens, comp, weight_itemsize, device) if k.cross_entropy == "fused_head" else
        tokens * tb.logits_forward + fused_forward_chunks(k.cross_entropy, local_vocab, tokens, device, comp), acts)
    mem = pick_stage(c, acts, tb.shared, pipeline_rank)
    mem.host_offload = tokens * acts.in_flight * acts.host
    if device == "cpu":
        mem.runtime = float(runtime_bytes)
    model_fpt = float(spec.flops_per_token(args, d.seq_len)) if spec.flops_per_token is not None else \
        3.0 * cfg.model.num_layers * figures.block_flops_per_token
    recomputed = c.checkpointed if policy == "full" else 0  # selective repeats no matmul
    hw_fpt = model_fpt + recomputed * lay.pp * figures.block_flops_per_token
    comm = fsdp_communication(lay, d.micro_num, k.grad_reduce, mem.stage, c.layers, figures.block_local,
                              figures.embedding_local, figures.head_local, c.gathered_itemsize) \
        if precision == "internlm_core" else Communication()
    stage_layers = c.layers * d.micro_num * tokens
    model_comm = {name: stage_layers * v for name, v in tb.communication.items()}
    embed = figures.embedding.count
    e = Estimate(cfg=cfg, layout=lay, precision=precision, attention=k.attention, cross_entropy=k.cross_entropy,
                 grad_reduce=k.grad_reduce, parameters=figures.total, nonembedding_parameters=figures.total - embed,
                 model_flops_per_token=model_fpt, hardware_flops_per_token=hw_fpt,
                 tokens_per_step=d.micro_bsz * d.seq_len * d.micro_num * lay.data, memory=mem, mfu=mfu,
                 peak_flops=peak_tflops * 1e12,
                 device_memory=device_memory_gib * GiB if device_memory_gib else None, communication=comm,
                 linear=k.linear, model_communication=model_comm,
                 context_bytes=context_exchange_bytes(cfg, lay, comp, c.layers))
    e.figures, e.model_args, e.token_bytes, e.stage_layers, e.checkpointed = figures, args, tb, c.layers, recomputed
    if device == "cuda":
        e.device_runtime = cuda_runtime_bytes(lay)
    e.notes = notes(e, c, acts.in_flight, pipeline_rank)
    apply_low_precision(e, c, acts, tb.shared, pipeline_rank)  # model.fp8, optimizer.name="muon"
    return e


def context_exchange_bytes(cfg: Config, lay: Layout, comp: int, layers: int) -> float:
    """Bytes one context rank sends per step for attention: model/context's count of one micro-batch's forward and
    backward through the stage's layers, times the micro-batches (0 without context parallel). Not counted: the
    forwards activation checkpointing repeats, and the all-gather of the document ids (a few bytes per token)."""
    if lay.cp == 1:
        return 0.0
    from ..model.context import predicted_context_bytes  # context-parallel runs only
    m, d = cfg.model, cfg.data
    kv = m.num_kv_attention_heads or m.num_attention_heads
    head_dim = m.head_dim or m.hidden_size // m.num_attention_heads
    one = predicted_context_bytes(lay.cp_mode, lay.cp, lay.cp_inner, d.micro_bsz, d.seq_len,
                                  m.num_attention_heads // lay.tp, max(kv // lay.tp, 1), head_dim, comp, layers)
    return float(one * d.micro_num)


def notes(e: Estimate, c: StageContext, in_flight: float, pipeline_rank: Optional[int]) -> list[str]:
    """The lines that say which accounting, kernels and layout the figures assume."""
    lay, mem, d, dtype = e.layout, e.memory, e.cfg.data, e.cfg.model.dtype.split(".")[-1]
    out = []
    if e.precision == "internlm_core":
        out.append("precision internlm_core: fp32 parameters, gradients and AdamW moments (16 B/parameter) "
                   f"sharded over zero1 ({lay.dp_shard}); "
                   + (f"FSDP gathers {dtype} weights (no autocast copies)" if c.fsdp_mp
                      else f"{dtype} autocast caches a 16-bit copy of every weight (kept to the end of the forward)"
                      if c.cached_casts else f"{dtype} autocast keeps 16-bit weight copies of non-recomputed layers "
                      f"(linear {e.linear})" if c.autocast else "fp32 compute"))
    else:
        out.append(f"precision internlm: bf16 parameters + gradients on every rank (4 B/parameter), fp32 master "
                   f"weights + AdamW moments (12 B/parameter) sharded over zero1 ({lay.dp_shard})")
    mask = e.attention == "sdpa" and not d.pack_sample_into_one
    out.append(f"attention {e.attention}" + (" with a packed-document mask per layer (a*s bytes per token)" if mask
                                             else " (probabilities kept for backward)" if e.attention == "cpu_blocked"
                                             else " (no attention matrix kept)") + f"; cross entropy {e.cross_entropy}")
    if e.precision == "internlm_core" and lay.dp_shard > 1 and d.micro_num > 1:
        if e.grad_reduce == "micro_batch":
            kept = 4 * e.parameters / lay.tp * (1 - 1 / lay.dp_shard)
            out.append(f"gradient accumulation: reduce-scatter after each of the {d.micro_num} micro-batches, so only "
                       f"the sharded fp32 gradients accumulate; reducing once per step would keep them unsharded, "
                       f"{kept / GiB:.1f} GiB more (--grad-reduce step)")
        else:
            out.append(f"gradient accumulation: reduced once per step, every gradient stays unsharded in fp32 over "
                       f"the {d.micro_num} micro-batches ({mem.accumulated_gradients / GiB:.1f} GiB beyond the shard)")
    if c.checkpointed and e.cfg.model.checkpoint != "selective":
        out.append(f"activation checkpointing: {c.checkpointed} of {c.layers} layers per stage keep only their input")
    if e.cfg.model.offload_activations:
        out.append(f"activation offload: the blocks' saved tensors on the host ({mem.host_offload / GiB:.2f} GiB per "
                   f"device), two blocks' worth counted on the device in backward")
    if e.cfg.model.checkpoint == "selective":
        out.append("selective activation checkpointing: each layer keeps its input and its matmuls' and attention's "
                   "outputs, the elementwise ops are recomputed" if e.token_bytes.selective is not None else
                   "selective activation checkpointing: the family gives no count of what it keeps (ModelCounts."
                   "selective_block_activations): counted as keeping every activation (an upper bound)")
    if lay.pp > 1 and mem.gradients == 0 and e.precision == "internlm_core":
        out.append(f"pipeline stage '{mem.stage}' runs all {d.micro_num} forwards before its first backward: its "
                   f"peak comes before the step's gradients exist (they are not counted)")
    if lay.pp > 1:
        which = f"stage {pipeline_rank} ('{mem.stage}')" if pipeline_rank is not None else \
            f"busiest stage '{mem.stage}'"
        out.append(f"pipeline: {which}, {in_flight:g} micro-batch(es) in flight on the first "
                   f"({lay.pipeline_schedule} schedule's action list)")
        if lay.pipeline_schedule in V_SHAPED:
            out.append(f"{lay.pipeline_schedule}: rank 0 runs the first and the last stage (embedding and head); "
                       f"the stage memory counts them on the first and the last rank as for 1F1B")
    comm = e.communication
    if comm.gathers:
        out.append(f"FSDP per step: {comm.gathered_bytes / GiB:.2f} GiB gathered in {comm.gathers} all-gathers, "
                   f"{comm.reduced_bytes / GiB:.2f} GiB reduced in {comm.reduces} reduce-scatters (the collectives' "
                   f"sizes; (n-1)/n of them cross the wire; comm/* metrics measure them)")
    for name, b in e.model_communication.items():
        out.append(f"{name}: {b / GiB:.2f} GiB per step (the family's own collectives)")
    if lay.cp > 1:
        out.append(f"context parallel {lay.cp} ({lay.cp_mode}): each rank holds {d.seq_len // lay.cp:,} tokens of "
                   f"every sequence (activations / {lay.cp}) and sends {e.context_bytes / GiB:.2f} GiB per step in "
                   f"the attention's exchanges (model/context's count)")
    return out
