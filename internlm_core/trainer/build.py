"""Wire one run from its config: each component by one small build function, in the order docs/architecture.md
("One run, top to bottom") lists."""

from __future__ import annotations

import dataclasses

import datetime
import json
import os
import platform
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..config import Config, dump_yaml
from ..config.fp8 import fp8_plan
from ..config.loader import compat_lines, config_to_dict
from ..config.recompute import fused_head_of
from ..distributed import LaunchInfo, ParallelDims, set_deterministic, set_seed
from ..estimate.fit import check_memory, fused_head_chosen
from ..fused_head import FusedHead
from ..loss import FlashGPTLMLoss
from ..metrics import AccPerplex, Throughput
from ..monitor import (AlertManager, LossHealthMonitor, MemoryProfiler, RestartReporter, build_loss_health,
                       build_profiler, build_stop_controller, build_straggler_monitor, build_watchdog)
from ..monitor.trackers import TrackerHub, build_trackers
from ..model import ModelInputs, build_model, count_parameters, model_args, model_flops_per_token, model_spec
from ..numerics import Kernels, Precision, resolve_precision, select_kernels
from ..optim import Beta2Scheduler, DynamicGradScaler, WarmupCosineLR, WarmupStableDecayLR, build_optimizer
from ..parallel import CommCounter, family_dims, fsdp_wraps, parallel_options, parallelize_model
from ..parallel.context import ContextCut
from ..parallel.float8 import check_fp8_layout, convert_to_fp8, float8_tp_styles, send_float8_as_bytes
from ..utils import collectives
from ..utils.logging import get_logger
from ..utils.memory import keep_freed_cpu_memory, return_large_freed_cpu_memory, trainable_parameter_bytes
from ..utils.peak import device_peak_flops
from ..utils.redact import redact_argv, redact_tree
from ..utils.timer import Timers
from ..utils.writer import MetricsWriter
from ..callbacks import CallbackList, TrainerCallback
from ..checkpoint import CheckpointManager, Checkpointer, RNGState, build_spike_rewind
from ..checkpoint.hf_export import build_hf_exporter
from .evaluation import build_evaluator
from .mtp import build_mtp_loss, check_family_mtp
from .hooks import SchedulerMetricHook
from .state import BatchSkipper, TrainState
from .parts import LoopConfig, TrainLoader
from .replicated import build_replicas
from .trainer import Trainer

if TYPE_CHECKING:
    from ..parallel.pipeline import PipelineParallel

logger = get_logger(__name__)


def resolve_run_dir(cfg: Config, run_dir: Optional[str], launch: LaunchInfo) -> Path:
    """`--run-dir`, or RUN/{JOB_NAME}/{launch_time}; the time comes from rank 0 so every rank agrees."""
    if run_dir is None:
        stamp = [datetime.datetime.now().strftime("%Y%m%d-%H%M%S")]
        if launch.distributed:
            collectives.broadcast_object_list(stamp, src=0)
        run_dir = os.path.join("RUN", cfg.JOB_NAME, stamp[0])
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path


_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
               "SLURM_JOB_NAME", "SLURM_NNODES", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_RESTART_COUNT",
               "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")


def write_run_files(cfg: Config, run_dir: Path, launch: LaunchInfo) -> None:
    """The resolved config (config.yaml) and how the run was launched (launch.json: command line, host,
    launcher, world size, the launcher's environment variables, versions), for the record; secrets redacted
    (`--set ...webhook_url=...` in the command line too, utils/redact.py)."""
    if launch.rank != 0:
        return
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    record = {"argv": redact_argv(sys.argv), "cwd": os.getcwd(), "host": socket.gethostname(), "pid": os.getpid(),
              "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "launcher": launch.launcher, "world_size": launch.world_size, "device": str(launch.device),
              "env": {k: os.environ[k] for k in _LAUNCH_ENV if k in os.environ},
              "versions": {"python": platform.python_version(), "torch": torch.__version__}}
    (run_dir / "launch.json").write_text(json.dumps(redact_tree(record), indent=1))


def setup_numerics(cfg: Config, seed: int, precision: Precision) -> None:
    set_seed(seed)
    set_deterministic(cfg.cudnn_deterministic, cfg.cudnn_benchmark)
    precision.apply_backend_settings()  # TF32 matmuls for torch.tf32 on CUDA


def build_kernels(cfg: Config, precision: Precision, device: torch.device, dims: ParallelDims) -> Kernels:
    """Every kernel choice of the run (attention, cross entropy, linear, optimizer, gradient reduction), logged."""
    # FSDP's view: context-parallel ranks shard and reduce like data-parallel ones
    return select_kernels(cfg.model, cfg.adam, precision, device, tp=dims.tp, dp=dims.dp_cp, dp_shard=dims.dp_shard_cp,
                          pp=dims.pp, micro_num=cfg.data.micro_num, label_smoothing=cfg.loss.label_smoothing,
                          moe_cfg=cfg.moe if cfg.model.num_experts > 1 else None)


def build_loss(cfg: Config, kernels: Kernels, model: Optional[torch.nn.Module] = None,
               pipeline: Optional[PipelineParallel] = None, fused: Optional[bool] = None) -> FlashGPTLMLoss:
    """The loss; with `model` and model.fused_head_loss deciding so (`fused`: estimate/fused_choice's decision for
    this run; None: fused_head_of), it applies the model's output layer itself (fused_head.py), the model stopping
    before it in training."""
    loss = FlashGPTLMLoss(kernels.cross_entropy, label_smoothing=cfg.loss.label_smoothing)
    # (under pipeline parallel the stages without the output layer compute no loss: nothing to fuse there)
    last = pipeline is None or pipeline.is_last
    fused = fused_head_of(cfg) if fused is None else fused
    if fused and cfg.model.fused_head_loss == "auto" and model is not None and not FusedHead.supports(model):
        fused = False  # "auto" only: True is refused in one line by FusedHead
        logger.info("model.fused_head_loss=\"auto\": unfused head (the model's output layer is not a bias-free linear)")
    if model is not None and fused and last:
        loss.fused_head = FusedHead(model, cfg.parallel.sequence_parallel and cfg.parallel.tensor > 1,
                                    tuple(pipeline.chunks) if pipeline is not None else ())
        logger.info("fused output head and cross entropy (model.fused_head_loss): no [tokens, vocab] logits")
    return loss


def build_schedulers(cfg: Config, optimizer: torch.optim.Optimizer) -> tuple[WarmupCosineLR, Beta2Scheduler]:
    ls, bs = cfg.lr_scheduler, cfg.beta2_scheduler
    if ls.name == "wsd":
        lr = WarmupStableDecayLR(optimizer, ls.total_steps, ls.warmup_ratio, ls.eta_min, ls.init_steps,
                                 ls.decay_start_step, ls.decay_ratio, ls.decay_shape)
    else:
        lr = WarmupCosineLR(optimizer, ls.total_steps, ls.warmup_ratio, ls.eta_min, ls.init_steps)
    beta2 = Beta2Scheduler(optimizer, bs.init_beta2, bs.c, bs.cur_iter)
    return lr, beta2


def build_grad_scaler(cfg: Config, precision: Precision) -> Optional[DynamicGradScaler]:
    """Loss scaling only for fp16 (bf16 and fp32 have the exponent range to do without)."""
    return DynamicGradScaler(cfg.grad_scaler) if precision.loss_scaling else None


def build_data(cfg: Config, dims: ParallelDims):
    from ..data import build_train_loader, build_valid_loaders
    kw = dict(dp_rank=dims.dp_rank, dp_size=dims.dp, vocab_size=cfg.model.vocab_size)
    ft = cfg.parallel.fault_tolerance  # replica groups: each trains on its own share of every global batch
    train = (dict(kw, dp_rank=ft.replica_id * dims.dp + dims.dp_rank, dp_size=ft.group_size * dims.dp)
             if ft.enable else kw)
    return build_train_loader(cfg.data, **train), build_valid_loaders(cfg.data, **kw)


def build_observers(cfg: Config, launch: LaunchInfo, dims: ParallelDims, run_dir: Path,
                    alerts: Optional[AlertManager], profiling: bool, model: torch.nn.Module,
                    kernels: Kernels) -> list[TrainerCallback]:
    """The run's monitoring observers (hang watchdog, stragglers, profiler, memory report), each only when its
    config asks for it. Observers decide nothing: the order they are told in is this list's, nothing depends on it."""
    rank = launch.rank
    memory = None
    if cfg.monitor.memory_report or profiling:
        # FSDP reducing once per step keeps the gradients unsharded between micro-batches (memory_report.py)
        unsharded = kernels.grad_reduce == "step" and dims.dp_shard_cp > 1 and cfg.data.micro_num > 1
        memory = MemoryProfiler(run_dir, rank, launch.device, accumulated=trainable_parameter_bytes(model)
                                * (dims.dp_shard_cp - 1) if unsharded else 0)
    observers = [
        build_watchdog(cfg.monitor, alerts, rank),
        build_straggler_monitor(cfg.data, rank, device=launch.device) if launch.distributed else None,
        build_profiler(run_dir, rank, enabled=profiling, dp_rank=dims.dp_rank, tp_rank=dims.tp_rank,
                       device=launch.device),
        memory,
    ]
    return [cb for cb in observers if cb is not None]


def build_checkpoint_manager(cfg: Config, parts: StatefulParts, launch: LaunchInfo, dims: ParallelDims,
                             run_dir: Path, alerts: Optional[AlertManager] = None) -> CheckpointManager:
    """The manager with its final run folder (named in the folder's lease) and the one place where everything that
    must survive a restart is registered (content names are load_ckpt_info's: model, optimizer, scheduler,
    sampler)."""
    ckpt = CheckpointManager(cfg.ckpt, rank=launch.rank, world_size=launch.world_size, local_rank=launch.local_rank,
                             dims=dims, config_text=dump_yaml(cfg), alerts=alerts, run_dir=run_dir)
    ckpt.register_model(parts.model, parts.optimizer, model_type=cfg.model_type)
    ckpt.register("grad_scaler", parts.grad_scaler, content="optimizer")  # None (skipped) unless fp16
    ckpt.register("lr_scheduler", parts.lr_scheduler, content="scheduler")
    ckpt.register("beta2_scheduler", parts.beta2_scheduler, content="scheduler")
    ckpt.register("train_state", parts.state, content="sampler")
    ckpt.register("data", parts.train_loader, content="sampler", scope="dp_rank")
    ckpt.register("rng", RNGState(), content="sampler", scope="rank", strict=False)
    # the spike detector's running mean: without it a resumed run would take its first loss as the baseline
    ckpt.register("loss_health", parts.loss_health, content="sampler", strict=False)
    # batches to skip, with those a spike rewind added (a restart skips them too), and the rewinds done so far
    ckpt.register("batch_skipper", parts.batch_skipper, content="sampler", strict=False)
    # the experiment trackers' run key: a resumed run continues the same tracker runs (None: no monitor.trackers)
    ckpt.register("trackers", parts.trackers, content="sampler", strict=False)
    return ckpt


@dataclass(frozen=True)
class StatefulParts:
    """Everything a checkpoint holds, built before the manager that registers it."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    grad_scaler: Optional[DynamicGradScaler]
    lr_scheduler: WarmupCosineLR
    beta2_scheduler: Beta2Scheduler
    state: TrainState
    train_loader: TrainLoader
    batch_skipper: BatchSkipper
    loss_health: LossHealthMonitor
    trackers: Optional[TrackerHub] = None


def choose_cpu_allocator(device: torch.device, dims: ParallelDims, simulated: bool) -> None:
    """How glibc treats freed tensor memory on a CPU run (utils/memory.py says why and what each costs): sharded
    data parallel returns large freed blocks at once, other runs keep freed memory for reuse; a simulated rank
    was set to follow live tensors by trainer/simulate.py and is left alone."""
    if device.type != "cpu" or simulated:
        return
    if dims.dp_shard_cp > 1:
        if return_large_freed_cpu_memory():
            logger.info("CPU allocator: freed blocks of 1 MiB or more go back to the OS at once (sharded data "
                        "parallel)")
    elif keep_freed_cpu_memory():
        logger.info("CPU allocator: freed tensor memory is kept for reuse (glibc mmap and trim off)")


def build_trainer(cfg: Config, launch: LaunchInfo, run_dir: Path, seed: Optional[int] = None,
                  extra_callbacks: Optional[list[TrainerCallback]] = None, alerts: Optional[AlertManager] = None,
                  profiling: bool = False) -> Trainer:
    """Assemble one run, completely, in this order: numerics and layout; model (sharded before it is materialized)
    and its pipeline; optimizer and schedules; data; the loop's instruments; monitors; the checkpoint manager with
    everything stateful registered and its lease; the resume (auto_resume / load_ckpt_info); the metrics writer
    (after the resume: a resumed run writes on where its checkpoint says); the loop's deciding parts (loss health,
    stop requests, spike rewind, checkpointer, Hugging Face export) and its observers (the monitors', then the
    driver's `extra_callbacks`). The Trainer is constructed last, from finished parts."""
    seed = cfg.seed if seed is None else seed
    simulated = launch.launcher == "simulate"
    for line in compat_lines(cfg):  # InternLM/InternEvo keys kept for compatibility only, forms translated
        logger.info(line)
    precision = resolve_precision(cfg.model.dtype, launch.device)
    setup_numerics(cfg, seed, precision)
    inputs = cfg.model_inputs()
    dims = ParallelDims.from_config(cfg.parallel, launch.world_size, extra=family_dims(model_spec(inputs), cfg.parallel, launch.world_size, inputs))
    dims.build_mesh(launch.device.type)
    precision = precision.under_fsdp(fsdp_wraps(dims))  # FSDP's policy casts: no autocast (numerics/precision.py)
    logger.info(precision.describe())
    kernels = build_kernels(cfg, precision, launch.device, dims)
    inputs = dataclasses.replace(inputs, expert_gemm=kernels.expert_gemm)  # the MoE layers' kernel, chosen once
    if not simulated:  # before any large allocation; --simulate checks its one rank itself (simulate.check_fits)
        check_memory(cfg, launch.world_size, launch.rank, launch.device, launch.distributed, kernels, dims.pp_rank)
    write_run_files(cfg, run_dir, launch)

    model, pipeline, args = build_parallel_model(inputs, cfg, dims, launch, seed, precision, kernels)
    optimizer = build_optimizer(model, cfg.adam, kernels.optimizer, cfg.optimizer,
                                model_spec(inputs).plan.blocks(model))
    lr_scheduler, beta2_scheduler = build_schedulers(cfg, optimizer)
    train_loader, valid_loaders = build_data(cfg, dims)
    evaluator = build_evaluator(cfg, dims, launch.device, launch.rank, run_dir, kernels.cross_entropy, simulated)
    state = TrainState(tensorboard_folder=str(run_dir / "tensorboard"))
    batch_skipper = BatchSkipper(cfg.data.skip_batches)
    grad_scaler = build_grad_scaler(cfg, precision)
    metric_hook, throughput = build_instruments(cfg, launch, dims, kernels, precision, args, train_loader)

    health = build_loss_health(cfg.monitor, alerts, launch.rank)
    stopper = build_stop_controller(cfg.ckpt, launch.rank, alerts)  # resets the stop file; signal handlers
    observers = build_observers(cfg, launch, dims, run_dir, alerts, profiling, model, kernels)
    trackers = None if simulated else build_trackers(cfg.monitor, cfg.JOB_NAME, config_to_dict(cfg), launch.rank,
                                                      launch.distributed, str(run_dir))
    parts = StatefulParts(model, optimizer, grad_scaler, lr_scheduler, beta2_scheduler, state, train_loader,
                          batch_skipper, health, trackers)
    ckpt = build_checkpoint_manager(cfg, parts, launch, dims, run_dir, alerts)
    rewinder = build_spike_rewind(cfg.monitor, ckpt, health)
    ckpt.register("spike_rewind", rewinder, content="sampler", strict=False)
    ckpt.resume()  # auto_resume / load_ckpt_info; takes the folder's lease
    if trackers is not None:
        trackers.start()  # after the resume: a resumed run continues its tracker runs
    writer = MetricsWriter(run_dir, active=launch.rank == 0 or simulated, log_every=cfg.monitor.log_every,
                           tensorboard_dir=state.tensorboard_folder if cfg.monitor.tensorboard else None,
                           sinks=[trackers] if trackers is not None else [])
    ft = cfg.parallel.fault_tolerance
    restart = RestartReporter(run_dir, launch.rank, launch.restart_count, launch.max_restarts, alerts, writer=writer,
                              replica_group=ft.replica_id if ft.enable and ft.group_size > 1 else None)
    choose_cpu_allocator(launch.device, dims, simulated)
    logger.info(f"run folder {run_dir} on {socket.gethostname()}")
    return Trainer(
        loop=LoopConfig.from_config(cfg, dims.tp, simulated=simulated), model=model,
        family=model_spec(cfg).hooks, pipeline=pipeline,
        loss_fn=build_loss(cfg, kernels, model, pipeline, fused_head_chosen(cfg, launch.world_size,
                                                                           launch.device.type)),
        precision=precision, kernels=kernels, optimizer=optimizer,
        lr_scheduler=lr_scheduler, beta2_scheduler=beta2_scheduler, grad_scaler=grad_scaler,
        train_loader=train_loader, valid_loaders=valid_loaders, batch_skipper=batch_skipper, state=state, dims=dims,
        device=launch.device, run_dir=run_dir, rank=launch.rank, world_size=launch.world_size,
        metric_hook=metric_hook, throughput=throughput,
        comm=CommCounter.attach(model) if dims.dp_shard_cp > 1 else None, writer=writer, checkpoint_manager=ckpt,
        health=health, stopper=stopper, checkpointer=Checkpointer(ckpt),
        callbacks=CallbackList([*observers, restart, *(extra_callbacks or [])]), rewinder=rewinder,
        hf_export=build_hf_exporter(cfg, model, ckpt),
        replicas=build_replicas(cfg, launch, ckpt, state),  # parallel.fault_tolerance: joins the quorum (None: off)
        evaluator=evaluator, context=ContextCut.of(dims),
        mtp=build_mtp_loss(cfg, model, build_loss(cfg, kernels), dims, launch.device))  # model.mtp (None: off)


def build_parallel_model(inputs: ModelInputs, cfg: Config, dims: ParallelDims, launch: LaunchInfo, seed: int,
                         precision: Precision, kernels: Kernels):
    """(model, pipeline, args): built on the meta device, then split, sharded and only then materialized (no rank
    holds the whole model), by the family's plan."""
    model = build_model(inputs, "meta", attn_backend=kernels.attention)
    check_family_mtp(cfg.model, cfg.model_type, model)  # model.mtp on: the family's module built its depths
    n_params = count_parameters(model)
    fp8 = fp8_plan(cfg.model.fp8)
    if fp8 is not None:  # float8 linears before tensor parallel, checkpointing, compile and FSDP wrap them
        check_fp8_layout(fp8, dims.tp)
        convert_to_fp8(model, model_spec(inputs).plan.blocks(model), fp8, device=launch.device,
                       grouped_experts=kernels.expert_gemm == "grouped")
    options = parallel_options(cfg)
    if fp8 is not None:  # tensor parallel: torchao's float8 styles for the tensorwise recipe
        options = dataclasses.replace(options, linear_styles=float8_tp_styles(fp8, launch.backend,
                                                                              cfg.parallel.sequence_parallel))
    model, pipeline = parallelize_model(model, model_spec(inputs), options, dims, launch.device,
                                        seed=seed, precision=precision, grad_reduce=kernels.grad_reduce)
    if fp8 is not None and fp8.fsdp_float8_all_gather and launch.backend == "gloo" and dims.dp_shard_cp > 1:
        send_float8_as_bytes(model)  # gloo has no float8 dtype: the gathered float8 weights travel as their bytes
    args = model_args(inputs, launch.device.type, attn_backend=kernels.attention)
    logger.info(f"model {cfg.model_type}: {n_params:,} parameters, {cfg.model.num_layers} layers, "
                f"hidden {cfg.model.hidden_size}, attention {kernels.attention}, dtype {cfg.model.dtype}; "
                f"layout {dims.describe()} on {launch.world_size} process(es), {launch.device}")
    return model, pipeline, args


def build_instruments(cfg: Config, launch: LaunchInfo, dims: ParallelDims, kernels: Kernels, precision: Precision,
                      args: Any, train_loader: TrainLoader) -> tuple[SchedulerMetricHook, Throughput]:
    """The loop's own timers and training metric (SchedulerMetricHook) and its throughput / MFU meter."""
    # MFU's denominator is the peak of the GEMM the linear layers run: fp32's where 16-bit layers multiply in fp32
    peak = device_peak_flops(launch.device, torch.float32 if kernels.linear == "fp32_gemm" else precision.compute_dtype,
                             tf32=precision.tf32)
    throughput = Throughput(model_flops_per_token(cfg, args), launch.world_size, peak)
    timers = Timers(device=launch.device)  # CUDA: device time between events, not host enqueue time
    type_names = dict(train_loader.type_names)
    # summed over data x context parallel x pipeline: each token counted once (only the last stage has outputs)
    metric = AccPerplex(type_names, dims.group("pp_dp") if dims.pp_dp > 1 else None)
    return SchedulerMetricHook(timers, metric), throughput
