"""Parameters, FLOPs per token, memory per device and time per step of a config on N GPUs, without running it.

    python tools/estimate.py --config configs/7B.py --gpus 64 --set parallel.zero1=8
    python tools/estimate.py --config configs/7B.py --gpus 8 --set model.checkpoint=True data.micro_bsz=8
    python tools/estimate.py --config configs/7B.py --gpus 8 --precision internlm --peak-tflops 312 --mfu 0.58
    python tools/estimate.py --config configs/7B.py --gpus 8 --gpu h200   # + predicted step time, MFU, what bounds it

Memory is the peak on the busiest device (or on a rank of pipeline stage `--pipeline-rank`): parameters,
gradients and optimizer state under the layout (tensor / pipeline / zero1 sharding), 16-bit weight copies kept
by autocast, what FSDP holds gathered, the activations of micro_bsz x seq_len tokens (activation checkpointing,
pipeline micro-batches in flight), the loss's backward, and the gradients FSDP keeps unsharded between
micro-batches where it reduces once per step; `--device cpu` adds what the CPU path keeps and the process
itself. `--precision internlm_core` (default) counts this code base (fp32 parameters + autocast);
`--precision internlm` counts InternLM's bf16 parameters with fp32 master weights (hybrid ZeRO-1). The time
per step is the model FLOPs of one step at the stated MFU of the stated peak. See internlm_core/estimate/ for
every term and the family's counts (model/<family>/counts.py) for its own. `--device cpu --linear fp32_gemm`:
a CPU without native 16-bit GEMM (default: this machine's), whose linear backward holds fp32 copies and whose
autocast copies are only the casts backward needs (a native GEMM's autocast caches every weight's cast).
"""

from __future__ import annotations

import argparse
import dataclasses
import json



def parse_args(argv=None) -> argparse.Namespace:
    from internlm_core.estimate import DEFAULT_MFU, DEFAULT_PEAK_TFLOPS, PRECISIONS
    from internlm_core.numerics.kernels import LINEAR

    p = argparse.ArgumentParser(description="Estimate parameters, FLOPs, memory per device and step time of a config.")
    p.add_argument("--config", required=True, help="Python (.py) or YAML config file")
    p.add_argument("--gpus", type=int, default=1, help="number of devices (world size), default 1")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="override config keys, e.g. parallel.zero1=8 data.micro_bsz=4 model.checkpoint=True")
    p.add_argument("--precision", choices=PRECISIONS, default="internlm_core",
                   help="internlm_core: fp32 parameters/gradients/AdamW sharded by FSDP + autocast (this code base); "
                        "internlm: bf16 parameters and gradients, fp32 master + AdamW sharded over zero1 (InternLM)")
    p.add_argument("--mfu", type=float, default=DEFAULT_MFU,
                   help=f"model FLOPs utilization assumed for the step time (default {DEFAULT_MFU})")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help=f"peak TFLOP/s of one device for the compute dtype (default: --gpu's, else "
                        f"{DEFAULT_PEAK_TFLOPS:g}: H100/H200 dense bf16; A100: 312)")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="device memory to check the total against (default: --gpu's, else 80; 0: no check)")
    p.add_argument("--gpu", default=None, metavar="NAME",
                   help="predict step time, tokens/s per GPU and MFU on this GPU (h100, h200, a100: "
                        "internlm_core/estimate/gpus.py), with the terms that bound it")
    p.add_argument("--no-flash-attn", action="store_true",
                   help="flash-attn not installed: attention on numerics' next choice, torch's varlen kernel "
                        "(default: installed)")
    p.add_argument("--no-torch-varlen", action="store_true",
                   help="with --no-flash-attn: torch's varlen kernel not there either: SDPA with document masks")
    p.add_argument("--expert-gemm", choices=["grouped", "loop"], default=None,
                   help="MoE expert GEMMs for --gpu (default: grouped on Hopper, loop on A100)")
    p.add_argument("--attention", choices=["flash", "torch_varlen", "sdpa", "cpu_blocked"], default=None,
                   help="attention kernel (default: what the trainer chooses with flash-attn installed: flash for "
                        "bf16/fp16 when the config uses flash-attn, else sdpa with document masks; "
                        "--no-flash-attn: its choice without flash-attn)")
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu",
                   help="gpu (default): CUDA devices with requirements-gpu.txt; cpu: this machine's CPU path (the "
                        "blocked attention and what it keeps, and the process itself: its resident memory after "
                        "loading the trainer's modules), as train.py --simulate runs it")
    p.add_argument("--pipeline-rank", type=int, default=None, metavar="R",
                   help="memory of pipeline stage R (train.py --simulate's rank 0 runs stage 0) instead of the busiest")
    p.add_argument("--grad-reduce", choices=["micro_batch", "step"], default=None,
                   help="when FSDP reduces gradients (default: the trainer's choice, every micro-batch under sharded "
                        "data parallel; 'step' keeps them unsharded in fp32 between micro-batches)")
    p.add_argument("--linear", choices=LINEAR, default=None,
                   help="linear kernel (default: what numerics chooses: on --device cpu this machine's, fp32_gemm "
                        "where the CPU has no native 16-bit GEMM for the dtype; torch on GPUs)")
    p.add_argument("--size", default=None, metavar="NAME",
                   help="a published shape of the config's model family (its ModelSpec.sizes, e.g. 13B with "
                        "configs/70B.py's LLAMA): its model keys over the config's, before --set")
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead of text")
    return p.parse_args(argv)


def size_overrides(config: str, name: str) -> list[str]:
    """`model.KEY=VALUE` items of the named shape `name` of the config's family (ModelSpec.sizes); ConfigError
    naming the family's sizes when it has none of that name."""
    from internlm_core.config import load_config
    from internlm_core.errors import ConfigError
    from internlm_core.model import get_model_spec

    spec = get_model_spec(load_config(config).model_type)
    if name not in spec.sizes:
        raise ConfigError(f"--size {name}: model_type {spec.name} has sizes {', '.join(spec.sizes) or '(none)'}")
    # the shape keys a size leaves out take their defaults (a 13B of Llama 2 has no GQA, whatever the config had)
    shape = {"num_kv_attention_heads": None, "intermediate_size": None, "head_dim": None, **spec.sizes[name]}
    return [f"model.{k}={v!r}" for k, v in shape.items()]


def main(argv=None) -> int:
    args = parse_args(argv)
    from internlm_core.config import load_config
    from internlm_core.errors import ConfigError
    from internlm_core.estimate import DEFAULT_PEAK_TFLOPS, GiB, Memory, estimate, format_estimate
    from internlm_core.estimate.gpus import gpu_spec
    from internlm_core.estimate.speed import default_attention, default_kernels, format_prediction, predict

    if args.gpus < 1:
        raise ConfigError(f"--gpus: expected a positive number of devices, got {args.gpus}")
    gpu = gpu_spec(args.gpu) if args.gpu else None
    if args.peak_tflops is None:
        args.peak_tflops = gpu.peak_tflops if gpu else DEFAULT_PEAK_TFLOPS
    if args.gpu_memory_gib is None:
        args.gpu_memory_gib = gpu.memory_gib if gpu else 80.0
    if not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu: expected a fraction in (0, 1], got {args.mfu}")
    sets = (size_overrides(args.config, args.size) if args.size else []) + list(args.set)
    cfg = load_config(args.config, sets, world_size=args.gpus)
    if args.pipeline_rank is not None and not 0 <= args.pipeline_rank < cfg.parallel.pipeline:
        raise ConfigError(f"--pipeline-rank: expected 0 <= R < parallel.pipeline ({cfg.parallel.pipeline}), "
                          f"got {args.pipeline_rank}")
    runtime = 0
    if args.device == "cpu":  # a CPU run's peak counts the process itself: measured with what train.py loads
        from internlm_core.trainer.simulate import process_before_model

        runtime = process_before_model()
    if args.no_flash_attn and args.attention is None:
        args.attention = default_attention(cfg, flash_attn=False, torch_varlen=not args.no_torch_varlen)
    kw = dict(mfu=args.mfu, peak_tflops=args.peak_tflops, attention=args.attention, grad_reduce=args.grad_reduce,
              device_memory_gib=args.gpu_memory_gib or None, device="cuda" if args.device == "gpu" else "cpu",
              pipeline_rank=args.pipeline_rank, runtime_bytes=runtime, linear=args.linear)
    e = estimate(cfg, args.gpus, precision=args.precision, **kw)
    other = estimate(cfg, args.gpus, precision="internlm" if args.precision == "internlm_core" else "internlm_core",
                     **kw)
    pred = predict(e, gpu, default_kernels(e, gpu, args.expert_gemm)) if gpu else None
    if args.json:
        mem = {k: getattr(e.memory, k) / GiB for k in Memory.ORDER}
        mem["total"] = e.memory.total / GiB
        mem["cuda_context_nccl"] = e.device_runtime / GiB  # outside the allocator, not in the total
        print(json.dumps({
            "config": args.config, "gpus": args.gpus, "layout": e.layout.describe(), "precision": e.precision,
            "attention": e.attention, "cross_entropy": e.cross_entropy, "grad_reduce": e.grad_reduce,
            "linear": e.linear,
            "parameters": e.parameters, "model_flops_per_token": e.model_flops_per_token,
            "hardware_flops_per_token": e.hardware_flops_per_token, "tokens_per_step": e.tokens_per_step,
            "memory_gib": mem, "stage": e.memory.stage, "communication": dataclasses.asdict(e.communication),
            "step_time_s": e.step_time, "tokens_per_device_per_second": e.tokens_per_device_per_second,
            "mfu": e.mfu, "peak_tflops": args.peak_tflops, "notes": e.notes,
            **({"model_communication": e.model_communication} if e.model_communication else {}),
            **({"prediction": {"gpu": pred.gpu.name, "step_time_s": pred.step_time, "mfu": pred.mfu,
                               "tokens_per_gpu_per_second": pred.tokens_per_gpu_per_second,
                               "kernels": dataclasses.asdict(pred.kernels), "terms_s": pred.terms,
                               "bound_by": pred.bound_by()}} if pred else {})}, indent=2))
        return 0
    print(f"{args.config} on {args.gpus} device(s)")
    print(format_estimate(e, other))
    if pred:
        print(format_prediction(pred))
    return 0


if __name__ == "__main__":
    from internlm_core.utils.cli import run_main

    run_main(main)
