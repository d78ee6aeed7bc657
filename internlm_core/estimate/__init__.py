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

Activations are the family's terms (`ModelSpec.counts`, model/counts.py; the InternLM transformer's table is in
model/internlm/counts.py, checked against `torch.autograd.graph.saved_tensors_hooks` in
tests/unit/test_estimate.py), each divided by the mesh dimensions it names, and the generic ones here: a
recomputed (checkpointed) layer keeps only its input, and one layer's worth is rebuilt at a time in backward.
Head (last pipeline stage), per token: the family's head terms, the logits (a * V, held by the trainer through
backward) and what the cross entropy kernel keeps: torch's (and vocab_parallel's) fp32 log-softmax (4V), with
two more fp32 V-wide buffers in its backward; the fused chunked kernel's precomputed gradient (a * V), scaled in
place in backward; flash-attn's nothing (its backward overwrites the logits). Pipeline: a stage holds L / pp
layers and, under 1F1B, up to min(pp, micro_num) micro-batches in flight (the first stage).

Time per step = (model FLOPs of one step) / (devices * MFU * peak FLOP/s); MFU counts model FLOPs
(6N + 12*L*h*s per token, no recomputation), as the throughput metric of the trainer does.

Modules: figures (Layout, Memory, Communication, Estimate), terms (a family's counts on one device), activations
(bytes per token, the loss's), memory (one pipeline stage), communication (FSDP's collectives), core
(`estimate`), report (`format_estimate`, `describe`).
"""

from ..model.counts import keys_per_query
from .communication import fsdp_communication
from .core import estimate
from .figures import DEFAULT_MFU, DEFAULT_PEAK_TFLOPS, GiB, PRECISIONS, Communication, Estimate, Layout, Memory
from .report import describe, format_estimate, memory_per_device

__all__ = ["DEFAULT_MFU", "DEFAULT_PEAK_TFLOPS", "GiB", "PRECISIONS", "Communication", "Estimate", "Layout", "Memory",
           "describe", "estimate", "format_estimate", "fsdp_communication", "keys_per_query", "memory_per_device"]
