"""Pipeline parallel: a manual stage split that keeps parameter names, run by torch.distributed.pipelining.

The model's `parallel.pipeline * model.num_chunks` virtual stages are cut by the family's plan
(`ParallelPlan.split_stages`). Rank r of the pipeline group runs stages r, r + pipeline, ... (torch's
"loop" placement), or r and 2 * pipeline - 1 - r under the V schedules (config/pipeline.py). Training steps use
`parallel.pipeline_schedule`'s torch schedule (`SCHEDULE_CLASSES`: 1F1B, interleaved 1F1B, and the zero-bubble
ones, whose backward is split into an input-gradient and a weight-gradient pass), with `data.micro_num`
micro-batches per step and the loss on the last stage, normalized as in the non-pipeline path (loss_norm.py: the
trainer's criterion applies the whole factor, the schedule divides nothing). Each micro-batch's index travels in
its target, which the schedule splits with the inputs: the criterion knows its micro-batch (its loss share) without
counting calls. Evaluation runs a plain forward-only loop with point-to-point sends (no autograd, any number of
micro-batches).
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
from torch.distributed.pipelining._backward import stage_backward
from torch.distributed.tensor import DTensor, Shard

from ..config.pipeline import SPLIT_BACKWARD, V_SHAPED, stage_ids as schedule_stage_ids
from ..errors import ConfigError
from ..model import ParallelPlan, document_ids_from_cu_seqlens
from ..model.probe import probe_forward
from ..utils import collectives, torch_compat
from ..utils.logging import get_logger

logger = get_logger(__name__)


SCHEDULE_CLASSES = {"1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
                    "interleaved_zb": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
                    "dualpipev": ScheduleDualPipeV}


def split_model(model: nn.Module, plan: ParallelPlan, pp_rank: int, pp_size: int, num_chunks: int,
                schedule: str = "auto") -> tuple[nn.Module, list[nn.Module], list[int]]:
    """Prune `model` to what pipeline rank `pp_rank` runs (the family's `plan.split_stages`);
    returns (model, chunks, stage_ids): rank r runs virtual stages r, r + pp_size, ... (torch's loop placement),
    or r and 2 * pp_size - 1 - r under a V schedule (`schedule`, config/pipeline.py)."""
    if plan.split_stages is None:
        raise ConfigError("parallel.pipeline: this model family has no pipeline split")
    stage_ids = schedule_stage_ids(schedule, pp_rank, pp_size, num_chunks)
    model, chunks = plan.split_stages(model, stage_ids, pp_size * num_chunks)
    return model, chunks, stage_ids


def stack_micro_batches(mbs: list[dict]) -> dict:
    """The schedule's inputs: the micro-batches concatenated along rows (it splits them again), with per-token
    document ids instead of one cu_seqlens per micro-batch (under context parallel the chunk's own ids, which its
    cut made), and `loss_shares`: each micro-batch's context-parallel loss share in order (fp32 on the host, 1.0
    without CP; micro_batch_mean's factor, loss_norm.py), which the criterion looks up by the index the
    micro-batch's target carries (`micro_batch_target`); with model.mtp also `mtp_shares`, each depth's share."""
    out = {k: torch.cat([mb[k] for mb in mbs]) for k in ("input_ids", "labels", "position_ids", "type_ids")
           + tuple(k for k in ("mtp_ids", "mtp_labels") if k in mbs[0])}  # model.mtp: its depths' ids and labels
    # kept on the host, where the model reads the attention layout without waiting for the device
    out["document_ids"] = torch.cat([mb["document_ids"] if "document_ids" in mb else
                                     document_ids_from_cu_seqlens(mb["cu_seqlens"], *mb["input_ids"].shape)
                                     for mb in mbs])
    out["loss_shares"] = torch.tensor([mb.get("loss_share", 1.0) for mb in mbs], dtype=torch.float32,
                                      device="cpu")
    if "mtp_labels" in mbs[0]:  # model.mtp: each depth's context share per micro-batch, [micro_num, D], as above
        depth = mbs[0]["mtp_labels"].shape[-1]
        out["mtp_shares"] = torch.tensor([mb.get("mtp_shares", [1.0] * depth) for mb in mbs], dtype=torch.float32,
                                         device="cpu")
    return out


def micro_batch_target(labels: torch.Tensor, type_ids: torch.Tensor, micro_num: int) -> torch.Tensor:
    """The schedule's target, [micro_num * rows, T, 3] (long): labels, dataset types and each row's micro-batch
    index. The schedule splits it along dim 0 with the inputs, so each loss call receives its micro-batch's index."""
    if labels.shape[0] % micro_num:
        raise ValueError(f"micro_batch_target: {labels.shape[0]} rows do not split into {micro_num} micro-batches")
    rows = labels.shape[0] // micro_num
    index = torch.arange(micro_num, dtype=labels.dtype, device=labels.device).view(-1, 1).expand(micro_num, rows)
    index = index.reshape(-1, *([1] * (labels.dim() - 1))).expand_as(labels)
    return torch.stack([labels, type_ids, index], dim=-1)


def split_target(target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(labels, type_ids, index) of one micro-batch's target (`micro_batch_target`); index: a 0-dim tensor on the
    target's device (read there, never on the host)."""
    return target[..., 0], target[..., 1], target[(0,) * (target.dim() - 1)][2]  # a view: no copy, no host read


# criterion(logits, labels, type_ids, index, record) -> the loss to backpropagate (see PipelineParallel.train_step)
Criterion = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def _static(stage_io: Optional[Callable[[int], tuple[torch.Tensor, torch.Tensor]]], stage: int) -> dict:
    """PipelineStage's static metadata (inputs, outputs and their gradients) from `stage_io`, or nothing."""
    if stage_io is None:
        return {}
    x, y = stage_io(stage)
    return {"input_args": x, "output_args": y, "output_grads": y,
            "input_grads": x if x.is_floating_point() else None}


class _Stage(PipelineStage):
    """torch's stage, with FSDP's gradients optionally reduce-scattered after every micro-batch (`reduce_each`).

    torch's schedules keep every FSDP gradient unsharded (in fp32, the reduce dtype) until the last
    micro-batch and reduce once; for a large stage that is 4 bytes per parameter of the stage beyond the
    shards (7 GiB per rank for a 70B model on 4 stages x 8-way tensor parallel). Reducing each micro-batch's
    gradients trades that for one reduce-scatter per micro-batch, as FSDP does outside the pipeline.
    """

    reduce_each = False
    inferring = False  # True while torch's metadata inference runs: a loss call then is no micro-batch of the step

    def _prepare_forward_infra(self, *args, **kwargs):
        # torch >= 2.13 runs each stage once on made-up inputs here (first step) to learn the shapes the stages
        # exchange: no layer statistics from it (model/probe.py; the MoE loads and losses were NaN / wrong)
        with probe_forward():
            return super()._prepare_forward_infra(*args, **kwargs)

    def _prepare_backward_infra(self, *args, **kwargs):
        # torch >= 2.13 learns the shapes the stages exchange from a real forward and backward of the first
        # micro-batch in here (on the first step), calling the loss on the last stage; torch 2.11 calls none here.
        # Observed, not predicted: the flag is up exactly while it runs.
        self.inferring = True
        try:
            with probe_forward():
                return super()._prepare_backward_infra(*args, **kwargs)
        finally:
            self.inferring = False

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        # The schedule runs forward and backward inside the trainer's autocast context. Backward must run
        # outside it, as `loss.backward()` does without a pipeline: on the CPU autocast is thread-local state
        # that the autograd engine keeps, so a custom Function's backward (the fp32-GEMM linear, the fused
        # loss) would have its fp32 matmuls cast back to 16 bits (measured: a 70B tp8 stage's backward
        # ~100x slower on a CPU without native bf16 GEMM).
        with torch.autocast(self.device.type, enabled=False):
            return self._backward(backward_type, bwd_kwargs, last_backward)

    def _backward(self, backward_type, bwd_kwargs: dict, last_backward: bool):
        if not (self.reduce_each and backward_type == "full" and isinstance(self.submod, FSDPModule)):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.submod.set_is_last_backward(False)  # the schedule's final reduction step ends the backward
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(True)
        return stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]), None


class _StaticStage(_Stage):
    """A stage of a simulated job: every stage has static shapes (`stage_io`), so the outcome of torch's warm-up
    vote (each stage votes static or dynamic; the product travels over point-to-point sends that fake peers never
    deliver) is known: static. Used only where torch holds that vote (`torch_compat.pipeline_warmup_vote`)."""

    def _warmup_backward_result(self, received_result=None):  # torch 2.13's vote (schedules._warmup_p2p)
        return torch.ones(1, dtype=torch.int64)


class PipelineParallel:
    """This rank's stages of the pipeline and the training schedule over them."""

    def __init__(self, chunks: list[nn.Module], stage_ids: list[int], num_stages: int, micro_num: int,
                 group: dist.ProcessGroup, device: torch.device, logits_mesh: Optional[DeviceMesh] = None,
                 stage_io: Optional[Callable[[int], tuple[torch.Tensor, torch.Tensor]]] = None,
                 reduce_each_micro_batch: bool = False, schedule: Optional[str] = None):
        """logits_mesh: the tensor-parallel mesh when the last stage outputs its local vocabulary shard of
        the logits (parallel_output); they are handed on as a DTensor sharded along the vocabulary.
        stage_io(stage) -> (input, output) of one micro-batch as meta tensors: the shapes the stages exchange,
        given instead of learned from the neighbours (a simulated job's fake peers send nothing).
        reduce_each_micro_batch: FSDP reduce-scatters every micro-batch's gradients (see `_Stage`); not under the
        split-backward schedules (said in the log), whose weight passes need the unsharded gradients to the end.
        schedule: `SCHEDULE_CLASSES`' key, resolved by config/pipeline.py (None: 1f1b with one stage per rank,
        else interleaved); the stages must be in its order (`split_model` with the same schedule)."""
        self.chunks, self.stage_ids, self.num_stages = chunks, stage_ids, num_stages
        self.logits_mesh = logits_mesh
        self.group, self.device = group, device
        self.pp_size = dist.get_world_size(group)
        self.micro_num = micro_num
        # a simulated job answers torch's warm-up vote itself where torch holds one (2.13); 2.11 holds none, and 2.15
        # decides from the static shapes without one on a fake backend (utils/torch_compat.py)
        stage_cls = _StaticStage if stage_io is not None and torch_compat.pipeline_warmup_vote() else _Stage
        self.stages = [stage_cls(c, s, num_stages, device, group=group, **_static(stage_io, s))
                       for c, s in zip(chunks, stage_ids)]
        self.schedule_name = schedule or ("1f1b" if len(self.stages) == 1 else "interleaved")
        if reduce_each_micro_batch and self.schedule_name in SPLIT_BACKWARD:
            logger.warning(f"parallel.pipeline_schedule={self.schedule_name!r}: FSDP reduce-scatters the stages' "
                           f"gradients once per step, not after every micro-batch (the weight passes run after "
                           f"later micro-batches' input passes): they stay unsharded in fp32 until then")
            reduce_each_micro_batch = False
        for stage in self.stages:
            stage.reduce_each = reduce_each_micro_batch
        self.schedule = self._build_schedule(micro_num)
        if not hasattr(PipelineStage, "_prepare_backward_infra"):
            raise RuntimeError(f"torch {torch.__version__}: PipelineStage has no _prepare_backward_infra to watch "
                               f"metadata inference through; update internlm_core/parallel/pipeline.py for this version")
        self._criterion: Optional[Criterion] = None
        self._head_input = False
        self._calls = 0  # loss calls of micro-batches this step (checked against micro_num, not used to find one)

    def _build_schedule(self, micro_num: int):
        """torch's schedule `schedule_name` over this rank's stages (losses through `_loss`, nothing divided)."""
        name, n = self.schedule_name, len(self.stages)
        if name == "1f1b":
            if n != 1:
                raise ConfigError(f"parallel.pipeline_schedule='1f1b' runs one stage per rank, got {n}")
            return Schedule1F1B(self.stages[0], micro_num, loss_fn=self._loss, scale_grads=False)
        if name in ("interleaved", "interleaved_zb"):
            rounds = max(1, micro_num // self.pp_size)
            if micro_num % rounds:
                raise ConfigError(f"data.micro_num ({micro_num}): the {name} pipeline schedule (model.num_chunks "
                                  f"{n}, parallel.pipeline {self.pp_size}) needs micro_num divisible by "
                                  f"max(1, micro_num // pipeline) = {rounds}")
        return SCHEDULE_CLASSES[name](self.stages, micro_num, loss_fn=self._loss, scale_grads=False)

    @property
    def is_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def is_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        if self.logits_mesh is None:
            return out
        return DTensor.from_local(out, self.logits_mesh, (Shard(-1),), run_check=False)

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        record = not any(stage.inferring for stage in self.stages)
        self._calls += record
        # the fused head (model.fused_head_loss): the last stage hands on the head's input, not vocabulary shards
        return self._criterion(logits if self._head_input else self._logits(logits), *split_target(target), record)

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor, type_ids: torch.Tensor,
                   position_ids: torch.Tensor, document_ids: torch.Tensor, criterion: Criterion,
                   head_input: bool = False, **model_inputs: torch.Tensor) -> None:
        """Forward and backward of `micro_num` micro-batches (all inputs [micro_num * rows, T], split along
        dim 0); on the last stage `criterion(logits, labels, type_ids, index, record)` gives the loss to
        backpropagate for micro-batch `index` (a 0-dim device tensor), already normalized: the schedule divides
        nothing. `record` is False for torch's metadata-inference call (`_Stage.inferring`): no metrics from it.
        model_inputs: more keyword inputs of every stage, split along dim 0 likewise (model.mtp's mtp_ids).
        head_input: the last stage stops before its output layer (the fused head, whose loss applies it): the
        criterion gets the head's input as the stage returns it."""
        if head_input and self.schedule_name in SPLIT_BACKWARD:  # config/pipeline.check_split_backward's rule
            raise ConfigError(f"model.fused_head_loss with parallel.pipeline_schedule={self.schedule_name!r}: the "
                              f"split backward gives the fused head wrong gradients; use the unfused head here")
        self._criterion, self._calls, self._head_input = criterion, 0, head_input
        self.schedule.step(input_ids, target=micro_batch_target(labels, type_ids, self.micro_num),
                           return_outputs=False, position_ids=position_ids, document_ids=document_ids,
                           **model_inputs)
        self._criterion = None
        if self.is_last and self._calls != self.micro_num:
            raise RuntimeError(f"torch {torch.__version__}: the pipeline schedule computed {self._calls} micro-batch "
                               f"losses outside metadata inference, expected {self.micro_num}; update "
                               f"internlm_core/parallel/pipeline.py for this version")

    # ---- forward only (evaluation) ----------------------------------------------------------------

    _DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]

    def _rank_of(self, stage: int) -> int:
        """The global rank running virtual stage `stage` (loop placement, or V: r and 2 * pp - 1 - r)."""
        local = stage % self.pp_size
        if self.schedule_name in V_SHAPED and stage >= self.pp_size:
            local = 2 * self.pp_size - 1 - stage
        return dist.get_global_rank(self.group, local)

    def _send(self, h: torch.Tensor, stage: int) -> None:
        dst = self._rank_of(stage)
        header = torch.tensor([self._DTYPES.index(h.dtype), *h.shape], dtype=torch.int64, device=self.device)
        collectives.send(header, dst)
        collectives.send(h.contiguous(), dst)

    def _recv(self, stage: int, ndim: int = 3) -> torch.Tensor:
        src = self._rank_of(stage)
        header = torch.empty(1 + ndim, dtype=torch.int64, device=self.device)
        collectives.recv(header, src)
        h = torch.empty(header[1:].tolist(), dtype=self._DTYPES[int(header[0])], device=self.device)
        collectives.recv(h, src)
        return h

    @torch.no_grad()
    def forward_only(self, micro_batches: list[dict]) -> Iterator[tuple[torch.Tensor, dict]]:
        """Run each micro-batch ({input_ids, position_ids, document_ids, ...}) through all stages; yields
        (logits, micro_batch) on the rank of the last stage. Every rank of the pipeline group must iterate
        to the end (the sends and receives follow one global order: micro-batch, then stage). Consecutive stages
        on one rank (the V schedules' turn) hand the hidden states on without a send."""
        mine = dict(zip(self.stage_ids, self.chunks))
        for mb in micro_batches:
            out = None
            for s in range(self.num_stages):
                if s not in mine:
                    continue
                x = mb["input_ids"] if s == 0 else out if s - 1 in mine else self._recv(s - 1)
                out = mine[s](x, position_ids=mb["position_ids"], document_ids=mb["document_ids"])
                if s == self.num_stages - 1:
                    yield self._logits(out), mb
                elif s + 1 not in mine:
                    self._send(out, s + 1)
