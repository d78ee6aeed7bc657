"""The step loop: micro_num forward/backward per batch, clip + step (skip on inf/nan), metrics; then the loop's
decisions of the step (loss health, stop requests, rewind, save, validation, evaluation, stop), each taken by a
named part the loop calls in that order (`Trainer.train`, `Trainer._decide`); callbacks only observe (callbacks.py)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel

from ..distributed.parallel_dims import ParallelDims
from ..loss import FlashGPTLMLoss
from ..loss_norm import LossNormalizer
from ..metrics import AccPerplex, Throughput
from ..model import TrainingHooks
from ..numerics import Kernels, Precision
from ..optim import Beta2Scheduler, DynamicGradScaler, WarmupCosineLR, clip_to_norm, unscale_and_norm
from ..utils import collectives
from ..utils.logging import get_logger
from ..utils.timer import Timers
from ..utils.transfer import to_device
from ..utils.writer import MetricsWriter
from ..callbacks import CallbackList, Progress, StepRequests, StepView
from ..checkpoint import CheckpointManager, Checkpointer, SaveDecision, SpikeRewinder
from ..checkpoint.hf_export import HFExporter
from ..monitor import LossHealthMonitor, StopController
from ..monitor.stop import StopDecision
from ..parallel import CommCounter
from ..parallel.fault_tolerance import ReplicaGroups
from ..parallel.context import ROW_KEYS, ContextCut
from . import replicated
from .hooks import SchedulerMetricHook
from .mtp import MTP_KEYS, MTPLoss, model_extras
from .parts import LoopConfig, TrainLoader, check_vocab
from .readout import StepValues, read_step
from .state import BatchSkipper, TrainState
from .validation import eval_outputs, validation_metrics

if TYPE_CHECKING:
    from ..parallel.pipeline import PipelineParallel
    from .evaluation import TaskEvaluator

logger = get_logger(__name__)

@dataclass
class Trainer:
    """One assembled run (`trainer.build.build_trainer` builds every field, resumes, then constructs it);
    `train()` runs the loop. Every field is finished when the trainer exists: nothing is attached later."""

    loop: LoopConfig
    # what is trained, and how it is computed
    model: torch.nn.Module
    family: TrainingHooks                 # the model family's part of the loop (MoE: aux-loss scale, metrics)
    pipeline: Optional[PipelineParallel]  # parallel.pipeline > 1: runs this rank's stages; else None
    loss_fn: FlashGPTLMLoss
    precision: Precision                  # autocast
    kernels: Kernels                      # numerics.select_kernels: when FSDP reduces gradients (grad_reduce)
    optimizer: torch.optim.Optimizer
    lr_scheduler: WarmupCosineLR
    beta2_scheduler: Beta2Scheduler
    grad_scaler: Optional[DynamicGradScaler]
    # data and progress
    train_loader: TrainLoader
    valid_loaders: dict[str, Iterable]
    batch_skipper: BatchSkipper
    state: TrainState
    # where this rank is
    dims: ParallelDims
    device: torch.device
    run_dir: Path
    rank: int
    world_size: int
    # the loop's own instruments: timers, the training metric, throughput, communication counter, writer
    metric_hook: SchedulerMetricHook
    throughput: Throughput
    comm: Optional[CommCounter]           # under FSDP: bytes gathered and reduced per step (comm/* metrics)
    writer: MetricsWriter                 # opened after any resume (a resumed run writes on where it stopped)
    checkpoint_manager: CheckpointManager  # registered, lease taken, resume done
    # the loop's decisions, each a named part it calls in its order (train, _decide)
    health: LossHealthMonitor             # judges each step's loss: inf/nan streaks (TrainingError), spikes
    stopper: StopController               # stop file and signals, polled after each step (a collective)
    checkpointer: Checkpointer            # when a step is saved (and the veto), the final save
    callbacks: CallbackList               # observers: each event gets a read-only StepView; they decide nothing
    rewinder: Optional[SpikeRewinder] = None  # monitor.spike_rewind: back to the checkpoint before a lasting spike
    hf_export: Optional[HFExporter] = None    # ckpt.hf_export_every
    replicas: Optional[ReplicaGroups] = None  # parallel.fault_tolerance: this rank's replica groups (torchft)
    evaluator: Optional[TaskEvaluator] = None  # evaluation.tasks (trainer/evaluation.py); None without tasks
    context: Optional[ContextCut] = None   # context parallel: this rank's zigzag chunk of every row
    mtp: Optional[MTPLoss] = None          # model.mtp: the depths' targets, loss terms and mtp_loss (trainer/mtp.py)
    requests: StepRequests = field(default_factory=StepRequests)  # what observers ask of this step (save, stop)
    last_metrics: dict = field(default_factory=dict)
    _step_end: float = 0.0  # perf_counter at the end of the last step: the start of the next step's time
    _validated_at: int = -1  # batch_count of the last validation

    # ---- pieces of one step -------------------------------------------------------------------

    def view(self, metrics: Optional[Mapping] = None) -> StepView:
        """What callbacks see of the run now: a frozen StepView (progress snapshot, read-only metrics)."""
        st, loaded = self.state, self.checkpoint_manager.loaded
        progress = Progress(st.batch_count, st.step_count, st.num_consumed_tokens, st.num_consumed_samples_in_epoch,
                            st.inf_nan_skip_batches)
        return StepView(st.batch_count, progress, self.run_dir, self.rank, self.world_size, self.model,
                        self.optimizer, self.requests, MappingProxyType(dict(metrics or {})),
                        loaded.url if loaded is not None else None)

    @property
    def timers(self) -> Timers:
        return self.metric_hook.timers

    @property
    def train_metric(self) -> AccPerplex:
        return self.metric_hook.metric

    def autocast(self) -> contextlib.AbstractContextManager:
        return self.precision.autocast()

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Vocabulary-parallel logits (tensor parallel, parallel_output): the loss and its backward run
        under torch's loss_parallel, which computes the softmax over the sharded vocabulary."""
        if self.loop.vocab_parallel_loss:
            return loss_parallel()
        return contextlib.nullcontext()

    def _micro_batches(self, batch: dict, n: int) -> Iterator[dict]:
        """Split a batch into micro-batches shaped [micro_bsz, seq_len] (rows never share a document); under
        context parallel each cut on the host into this rank's chunk (document ids and loss share with it)."""
        seq_len = self.loop.seq_len
        for i in range(n):
            rows = batch["input_ids"][i].numel() // seq_len
            mb = {k: batch[k][i].view(rows, seq_len) for k in ROW_KEYS}
            mb["cu_seqlens"] = batch["cu_seqlens"][i]
            if self.mtp is not None and self.model.training:  # model.mtp: from the whole rows, before any cut
                mb = self.mtp.targets(batch, i, mb, seq_len)
            if self.context is not None:
                mb = self.context(mb)  # document_ids stay on the host, where the model reads the layout
            yield {k: to_device(v, self.device) if k in ROW_KEYS + MTP_KEYS else v for k, v in mb.items()}

    def _forward(self, mb: dict) -> torch.Tensor:
        """The model on one micro-batch: its documents as cu_seqlens, or per-token ids under context parallel."""
        if "document_ids" in mb:  # context parallel: the whole rows' ids (host), which no rank has to exchange
            return self.model(mb["input_ids"], mb["position_ids"],
                              document_ids=mb.get("row_document_ids", mb["document_ids"]), **model_extras(mb))
        return self.model(mb["input_ids"], mb["position_ids"], mb["cu_seqlens"], **model_extras(mb))

    def forward_backward(self, batch: dict, forward_only: bool = False) -> torch.Tensor:
        """Run all micro-batches; returns this rank's part of the step's loss (loss_norm.py's `rank_loss`: a
        detached scalar; under pipeline parallel 0 on ranks without the last stage)."""
        n = batch["input_ids"].shape[0]
        scale = self.grad_scaler.scale if (self.grad_scaler is not None and not forward_only) else 1.0
        with self.loss_context():
            if self.pipeline is not None:
                if forward_only:
                    raise ValueError("forward_only under pipeline parallel: use evaluate()")
                return self._pipeline_forward_backward(batch, n, scale)
            return self._forward_backward(batch, n, scale, forward_only)

    def _forward_backward(self, batch: dict, n: int, scale: float, forward_only: bool) -> torch.Tensor:
        total, norm = torch.zeros((), device=self.device), LossNormalizer.of_step(
            self.loop.loss_reduction, n, self.dims, batch["labels"], self.device)  # N before the first backward
        hook, fire, view = self.metric_hook, self.callbacks.fire, self.view()
        for i, mb in enumerate(self._micro_batches(batch, n)):
            last = i == n - 1
            if not forward_only and hasattr(self.model, "set_requires_gradient_sync"):
                self._gradient_sync(last)
            with self.autocast():
                fire("on_before_forward", view)
                with hook.phase("fwd"):
                    fused = self.loss_fn.fused_head  # model.fused_head_loss: the model stops before its output layer
                    with fused.deferred() if fused is not None else contextlib.nullcontext():
                        logits = self._forward(mb)  # (then the head's input: the loss applies the head)
                fire("on_after_forward", view)
                fire("on_before_criterion", view)
                with hook.phase("cal_loss"):
                    loss, side = (self.loss_fn if fused is None else self.loss_fn.fused)(logits, mb["labels"])
                loss = norm.part(loss, mb["labels"], mb.get("loss_share"))  # the chunk's term of the step's loss
                mtp = self.mtp.term(norm, mb["mtp_labels"], mb.get("mtp_shares")) if self.mtp is not None else 0.0
                fire("on_after_criterion", view)
            logits = logits.detach()
            hook.record(logits, mb["labels"], mb["type_ids"], side.token_losses, side.predictions)
            fire("on_micro_batch_end", view, logits, mb["labels"], mb["type_ids"], side.token_losses,
                 side.predictions)
            del logits, side  # not alive during the next micro-batch's forward
            total += loss.detach()
            if not forward_only:
                fire("on_before_backward", view)
                self.family.before_backward(self.model, norm.aux_factor(scale))
                with hook.phase("bwd"):
                    ((loss + mtp) * norm.backward_factor(scale)).backward()
                fire("on_after_backward", view)
        return norm.rank_loss(total)

    def _gradient_sync(self, last: bool) -> None:
        """FSDP, by Kernels.grad_reduce: sharded data parallel reduce-scatters every micro-batch (and HSDP
        all-reduces across replicas at the last only); otherwise gradients are reduced at the last micro-batch."""
        every = self.kernels is not None and self.kernels.grad_reduce == "micro_batch"
        self.model.set_requires_gradient_sync(last or every)
        if every and hasattr(self.model, "set_requires_all_reduce"):
            self.model.set_requires_all_reduce(last)

    def _pipeline_forward_backward(self, batch: dict, n: int, scale: float) -> torch.Tensor:
        """One step through torch.distributed.pipelining: the last stage computes each micro-batch's loss, feeds
        the metrics and backpropagates it normalized as above (the schedule divides nothing)."""
        total, norm = torch.zeros((), device=self.device), LossNormalizer.of_step(
            self.loop.loss_reduction, n, self.dims, batch["labels"], self.device)  # N before the first backward
        hook, fire, view = self.metric_hook, self.callbacks.fire, self.view()
        from ..parallel.pipeline import stack_micro_batches  # torch.distributed.pipelining: pipeline runs only
        x = stack_micro_batches(list(self._micro_batches(batch, n)))
        shares = to_device(x["loss_shares"], self.device)  # micro_batch_mean: looked up by the index of the target
        loss_fn = self.loss_fn if (fused := self.loss_fn.fused_head) is None else self.loss_fn.fused  # model.fused_head_loss

        def criterion(logits: torch.Tensor, labels: torch.Tensor, type_ids: torch.Tensor, index: torch.Tensor,
                      record: bool) -> torch.Tensor:
            if not record:  # torch's metadata inference: its gradients are discarded, no metrics
                return norm.part(loss_fn(logits, labels)[0], labels, shares[index]) * norm.backward_factor(scale)
            fire("on_before_criterion", view)
            with hook.phase("cal_loss"):
                loss, side = loss_fn(logits, labels)
            fire("on_after_criterion", view)
            hook.record(logits.detach(), labels, type_ids, side.token_losses, side.predictions)
            fire("on_micro_batch_end", view, logits.detach(), labels, type_ids, side.token_losses, side.predictions)
            loss = norm.part(loss, labels, shares[index])
            mtp = self.mtp.term_at(norm, x, index) if self.mtp is not None else 0.0  # model.mtp's depths
            total.add_(loss.detach())
            return (loss + mtp) * norm.backward_factor(scale)

        self.family.before_backward(self.model, norm.aux_factor(scale))
        with self.autocast(), hook.phase("fwd_bwd"), fused.deferred() if fused is not None else contextlib.nullcontext():
            self.pipeline.train_step(x["input_ids"], x["labels"], x["type_ids"], x["position_ids"],
                                     x["document_ids"], criterion, head_input=fused is not None, **model_extras(x))
        return norm.rank_loss(total)

    def optimizer_step(self) -> tuple[bool, float]:
        """`step` of the gradients alone (no loss, no metrics): (whether it stepped, the global gradient norm)."""
        success, v = self.step(torch.zeros((), device=self.device), metric=False)
        return success, v.grad_norm

    def step(self, loss: torch.Tensor, metric: bool = True) -> tuple[bool, StepValues]:
        """Clip and step, or skip (inf/nan on any rank) as the step's one host read says (readout.py: the global
        `loss`, the norm, the metric sums, the stop request). Returns (stepped, values)."""
        params, scaler = [p for p in self.model.parameters() if p.requires_grad], self.grad_scaler
        norm = unscale_and_norm(params, 1.0 / scaler.scale if scaler is not None else 1.0,
                                pp_group=self.dims.group("pp") if self.dims.pp > 1 else None)
        sums = self.train_metric.reduced_sums() if metric else None
        v = read_step(self._reduce_loss(loss, read=False), norm, self.stopper, self.device, self.world_size > 1, sums)
        finite = v.finite or self.loop.simulated
        if self.grad_scaler is not None:
            self.grad_scaler.update(not finite)
        if finite:
            clip_to_norm(params, self.loop.clip_grad_norm if v.finite else 0.0, norm)  # simulated: no clip of inf/nan
            self.optimizer.step()
            self.family.after_step(self.model, self.dims.group("dp_cp") if self.dims.dp_cp > 1 else None)
            self.lr_scheduler.step()
            self.beta2_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return finite, v

    def _reduce_loss(self, loss: torch.Tensor, read: bool = True) -> float | torch.Tensor:
        """The step's loss L (loss_norm.py): the ranks' parts summed over "pp_dp" (under pipeline parallel the last
        stage's; the others hold 0) and divided by dp. A float, or with `read=False` a device scalar (no host read)."""
        if self.dims.pp_dp > 1:
            loss = loss.clone()
            collectives.all_reduce(loss, op=dist.ReduceOp.SUM, group=self.dims.group("pp_dp"))
            loss = LossNormalizer(self.loop.micro_num, self.dims.dp, self.dims.cp).global_loss(loss)
        return loss.item() if read else loss

    # ---- the loop --------------------------------------------------------------------------------

    def train_step(self, batch: dict, t_start: float) -> Optional[dict]:
        """One batch: forward/backward, step, metrics record; None when replica groups did not commit the step
        (its gradients are dropped; `train` trains the same batch again).

        `step_time` runs from `t_start` (the end of the previous step, see `train`) to the end of this
        optimizer step, so it includes data loading and everything done between steps (metrics, writers,
        callbacks, checkpoint saving) as the peer benchmark measures a step; validation is not in it."""
        self.model.train()
        if self.comm is not None:
            self.comm.reset()  # this step's collectives only (not the validation before it)
        loss = self.forward_backward(batch)
        st = self.state
        with self.timers("optim"):
            if self.replicas is not None and not replicated.commit(self.replicas, self.model, self.optimizer,
                                                                   st.batch_count):
                return None
            success, v = self.step(loss)
        if success:
            st.step_count += 1
        else:
            st.inf_nan_skip_batches += 1
            logger.warning(f"step {st.batch_count}: gradient norm is {v.grad_norm}; update skipped "
                           f"({st.inf_nan_skip_batches} skipped so far)")
        self._step_end = time.perf_counter()
        elapsed = self._step_end - t_start
        tokens = batch["input_ids"].numel() * self.dims.dp
        metrics = {"step": st.batch_count, "loss": v.loss, "lr": self.optimizer.param_groups[0]["lr"],
                   "grad_norm": v.grad_norm, **self.throughput.compute(tokens, elapsed),
                   "num_consumed_tokens": st.num_consumed_tokens, "inf_nan_skip_batches": st.inf_nan_skip_batches,
                   "skipped": not success, "step_time": elapsed,
                   "adam_beta2": self.optimizer.param_groups[0]["betas"][1]}
        if self.grad_scaler is not None:
            metrics["loss_scale"] = self.grad_scaler.scale
        per_type = self.train_loader.consumed_tokens_per_type()  # all ranks' tokens of each type so far
        metrics.update(self.metric_hook.step_metrics(per_type, v.metric_sums))
        if self.comm is not None:
            metrics.update(self.comm.pop())
        if self.context is not None:
            metrics.update(self.context.step_metrics())
        metrics.update(self.family.step_metrics(self.model, self.dims.group("dp_cp") if self.dims.dp_cp > 1 else None,
                                                self.dims.group("pp") if self.dims.pp > 1 else None))
        metrics.update(self.mtp.step_metrics(self.dims) if self.mtp is not None else {})  # mtp_loss
        if self.replicas is not None:
            metrics.update(self.replicas.step_metrics())  # ft/participants, ft/quorum_time, ...
        return metrics

    def train(self) -> TrainState:
        """Train until `data.total_steps` batches are done or a stop is decided. Each step, in this order: the
        replica groups' quorum (torchft only), data, forward/backward and optimizer step -- or, when the replica
        groups did not commit it, the same batch again --, metrics; then the step's decisions (`_decide`)."""
        loop, st = self.loop, self.state
        self.callbacks.fire("on_train_start", self.view())
        train_iter = iter(self.train_loader)
        logger.info(f"training from batch {st.batch_count} to {loop.total_steps} "
                    f"(micro_num={loop.micro_num}, packed_length={loop.packed_length}, dp={self.dims.dp})")
        self._step_end = time.perf_counter()
        stop = StopDecision()
        try:
            while st.batch_count < loop.total_steps:
                t_start = self._step_end  # the end of the previous step: its metrics, writers and callbacks count
                attempt = (replicated.begin_step(self.replicas, st, self.train_loader, self.writer)
                           if self.replicas is not None else None)  # the quorum; a heal may move the run on
                with self.timers("data"):
                    batch = next(train_iter)
                index = st.batch_count
                st.batch_count += 1
                st.num_consumed_samples_in_epoch += batch["input_ids"].shape[0]
                st.num_consumed_tokens += batch["input_ids"].numel() * self.dims.dp
                if self.batch_skipper(index):  # data.skip_batches, and the batches a spike rewind added
                    logger.info(f"skip batch {index} (data.skip_batches)")
                    self.timers.pop()
                    self._step_end = time.perf_counter()
                    continue
                check_vocab(batch, loop.vocab_size, st.batch_count)
                metrics = self.train_step(batch, t_start)
                if metrics is None:  # the replica groups did not commit: the same batch, under a new quorum
                    attempt.restore(st, self.train_loader)
                    self.train_metric.reset()  # the attempt's micro-batches count again when trained again
                    self.timers.pop()
                    continue
                self.last_metrics = metrics
                self.writer.write(st.batch_count, metrics)
                stop = self._decide(metrics)
                if stop.stop:
                    logger.info(f"stopping after step {st.batch_count}: {stop.reason}")
                    break
            self._finish(stop)
        finally:
            if self.replicas is not None:
                self.replicas.close()  # leave the quorum at once: the peers need not wait for a heartbeat to stop
        return st

    def _decide(self, metrics: dict) -> StopDecision:
        """A step's decisions, in order: judge the loss health, tell the observers, poll stop requests, then rewind,
        save, validate, evaluate; returns the stop decision (`.stop`: the run ends after this step)."""
        step = self.state.batch_count
        self.health.judge(metrics)  # TrainingError after monitor.max_consecutive_inf_nan bad steps in a row
        unhealthy = self.health.unhealthy(spikes=self.rewinder is not None and self.rewinder.vetoes_spikes)
        self.callbacks.fire("on_step_end", self.view(metrics), MappingProxyType(metrics))
        stop = self.stopper.poll(step).asked(*self.requests.take())  # stop file, signals; observers' requests
        if self.rewinder is not None and self.rewinder.due(self.health.spike_streak):
            outcome = self.rewinder.rewind(self.health.spike_streak)  # every state back to the checkpoint before
            self.batch_skipper.add(outcome.skip_batches)  # the spiking batches are skipped from now on
            self.health.forget_spikes()
            self.writer.write(outcome.step, outcome.record, kind="rewind")
            return stop  # the spiking steps are gone: nothing of them is saved, validated or evaluated
        save = self.checkpointer.due(step, stop.save, stop.reason)
        if save is not None:
            self._save(save, unhealthy)
        if self.hf_export is not None:
            self.hf_export.maybe_export(step, unhealthy)
        if self.loop.valid_every > 0 and step % self.loop.valid_every == 0:
            self.evaluate()
            self._step_end = time.perf_counter()  # validation has its own valid_time
        if self.evaluator is not None and self.evaluator.due(step):
            self.evaluate_tasks()
            self._step_end = time.perf_counter()  # as validation: eval_time
        return stop

    def _save(self, decision: SaveDecision, unhealthy: Optional[str]) -> None:
        step = self.state.batch_count
        path = self.checkpointer.save(step, decision, unhealthy)
        if path is not None:
            self.callbacks.fire("on_save", self.view(), step, path)

    def _finish(self, stop: StopDecision) -> None:
        """After the last step (or a stop): the final validation and evaluation, the final save, the observers'
        on_train_end; then the background writes are waited for (CheckpointError if the last save failed)."""
        loop, st = self.loop, self.state
        if loop.validate_at_end and st.batch_count >= loop.total_steps and self._validated_at != st.batch_count:
            self.evaluate()  # the final validation data.valid_every promises
        ev = self.evaluator
        if ev is not None and ev.at_end and st.batch_count >= loop.total_steps and ev.last_step != st.batch_count:
            self.evaluate_tasks()
        final = self.checkpointer.final(st.batch_count, stop.stop, stop.reason)
        if final is not None:
            self._save(final, self.health.unhealthy(spikes=self.rewinder is not None and self.rewinder.vetoes_spikes))
        self.stopper.close()
        self.callbacks.fire("on_train_end", self.view())
        if self.hf_export is not None:
            self.hf_export.wait()
        self.checkpointer.close()
        self.writer.close()

    def _eval_outputs(self, batch: dict) -> Iterator[tuple[torch.Tensor, dict]]:
        """(logits, micro-batch) of each micro-batch; under pipeline parallel only on the last stage."""
        yield from eval_outputs(list(self._micro_batches(batch, batch["input_ids"].shape[0])), self._forward,
                                self.pipeline)

    @torch.no_grad()
    def evaluate_tasks(self) -> dict:
        """evaluation.tasks scored with the current weights through the evaluation forward (sharded as training)."""
        self.model.eval()
        results = self.evaluator.run(self._eval_outputs, lambda: (self.autocast(), self.loss_context()),
                                     self.state.batch_count)
        self.timers.pop()
        self.model.train()
        self.writer.write(self.state.batch_count, results, kind="eval")
        return results

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Loss, ACC and PPL on every validation dataset (reported separately), averaged over dp ranks."""
        if not self.valid_loaders:
            return {}
        self._validated_at = self.state.batch_count
        self.model.eval()
        t0 = time.perf_counter()
        results = validation_metrics(self.valid_loaders, self._eval_outputs,
                                     lambda: (self.autocast(), self.loss_context()), self.loss_fn, self.train_metric)
        results["valid_time"] = time.perf_counter() - t0
        self.timers.pop()
        self.model.train()
        self.writer.write(self.state.batch_count, results, kind="valid")
        self.callbacks.fire("on_validation_end", self.view(), MappingProxyType(results))
        return results
