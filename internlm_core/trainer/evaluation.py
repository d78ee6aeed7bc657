"""Evaluation during training: multiple-choice task files (`evaluation.tasks`) scored every `evaluation.eval_every`
steps and at the end, with the log-likelihoods lm-evaluation-harness computes (data/eval_tasks.py says how the
requests are tokenized; tools/evaluate.py runs lm-eval itself on an exported checkpoint).

The requests are packed into rows and run through the trainer's evaluation forward, sharded as in training (FSDP,
tensor and pipeline parallel); the loss path gives each token's cross entropy (vocabulary-parallel logits are never
gathered), and each request's log-likelihood is minus the sum over its continuation's tokens. Only those sums cross
ranks: one float64 per request, summed over the data-parallel ranks and pipeline stages that own it.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from ..config import Config
from ..data.eval_tasks import (EvalTask, Request, build_requests, choice_metrics, deal_batches, make_batch, per_doc,
                               read_task)
from ..distributed import ParallelDims
from ..errors import ConfigError
from ..loss import FlashGPTLMLoss
from ..utils import collectives
from ..utils.logging import get_logger

logger = get_logger(__name__)

# (logits, micro-batch) of each micro-batch of a batch: the trainer's `_eval_outputs` (only the last pipeline stage
# yields)
Outputs = Callable[[dict], Iterator[tuple[torch.Tensor, dict]]]
Contexts = Callable[[], Iterable[contextlib.AbstractContextManager]]


@dataclass
class TaskEvaluator:
    """The tasks, this rank's packed batches of their requests, and when to run them."""

    tasks: list[EvalTask]
    requests: list[Request]
    seq_len: int
    batches: list[list[list[int]]]    # this rank's share: per batch, per row, request indices (deal_batches)
    loss_fn: FlashGPTLMLoss           # the run's cross entropy kernel without label smoothing: log-likelihoods
    every: int                        # evaluation.eval_every (0: only at the end)
    at_end: bool
    group: Optional[dist.ProcessGroup] = None  # "pp_dp": the ranks that hold parts of the sums (None: one process)
    device: torch.device = torch.device("cpu")
    details_path: Optional[Path] = None  # rank 0: eval_details.jsonl (per-document log-likelihoods)
    last_step: int = -1

    def due(self, step: int) -> bool:
        """True at every `eval_every`-th step."""
        return self.every > 0 and step % self.every == 0

    @torch.no_grad()
    def loglikelihoods(self, outputs: Outputs, contexts: Contexts) -> list[float]:
        """Each request's log-likelihood (the sum of its continuation tokens' log-probabilities), on every rank;
        `contexts()` gives the context managers each forward and loss run under (autocast, loss_parallel)."""
        device = collectives.group_device(self.group) if self.group is not None else self.device
        lls = torch.zeros(len(self.requests), dtype=torch.float64, device=device)
        for rows in self.batches:
            batch = make_batch(self.requests, rows, self.seq_len)  # built when needed: requests take less memory
            with contextlib.ExitStack() as stack:
                for c in contexts():
                    stack.enter_context(c)
                for logits, mb in outputs(batch):  # none on the stages before the last
                    _, side = self.loss_fn(logits, mb["labels"])
                    owner = mb["type_ids"].reshape(-1).to(device)  # eval_batches: the request of each label
                    scored = owner >= 0
                    lls.index_add_(0, owner[scored], side.token_losses.reshape(-1).to(device)[scored].double(),
                                   alpha=-1.0)
        if self.group is not None:
            collectives.all_reduce(lls, group=self.group)
        return lls.tolist()

    def run(self, outputs: Outputs, contexts: Contexts, step: int) -> dict[str, float]:
        """Score every task: {"eval/<task>/acc", "eval/<task>/acc_norm", "eval/<task>/loglik", "eval_time"}; rank 0
        appends the per-document log-likelihoods to eval_details.jsonl."""
        t0 = time.perf_counter()
        values = self.loglikelihoods(outputs, contexts)
        results: dict[str, float] = {}
        details = []
        for t, task in enumerate(self.tasks):
            lls = per_doc(t, task, self.requests, values)
            m = choice_metrics(task, lls)
            results.update({f"eval/{task.name}/{k}": v for k, v in m.items()})
            details.append({"step": step, "task": task.name, "path": task.path, **m, "loglikelihoods": lls})
        results["eval_time"] = time.perf_counter() - t0
        self.last_step = step
        if self.details_path is not None:
            with open(self.details_path, "a") as fh:
                fh.writelines(json.dumps(d) + "\n" for d in details)
        return results


def load_eval_tokenizer(cfg: Config) -> Any:
    """The run's tokenizer (`tokenizer`, else `data.tokenizer_path`): task files are tokenized as the data was."""
    from ..data.tokenizers import load_tokenizer

    spec = cfg.tokenizer or cfg.data.tokenizer_path
    if spec is None:
        raise ConfigError("evaluation.tasks: the tasks are tokenized with the run's tokenizer; set `tokenizer` "
                          "(byte, a SentencePiece .model or a tokenizer.json)")
    return load_tokenizer(spec)


def build_evaluator(cfg: Config, dims: ParallelDims, device: torch.device, rank: int, run_dir: Path,
                    cross_entropy: str, simulated: bool = False) -> Optional[TaskEvaluator]:
    """The evaluator of `evaluation.tasks` (None without tasks, and on a simulated rank): task files read and
    checked, requests tokenized and packed (this rank's share) before training starts."""
    ev = cfg.evaluation
    if not ev.tasks or simulated:
        return None
    tokenizer = load_eval_tokenizer(cfg)
    tasks = [read_task(t["name"], t["path"], f"evaluation.tasks[{i}].path") for i, t in enumerate(ev.tasks)]
    seq_len = cfg.data.seq_len
    requests = build_requests(tasks, tokenizer, seq_len, cfg.model.vocab_size, ev.target_delimiter)
    batches = deal_batches(requests, seq_len, ev.batch_size, dims.dp_rank, dims.dp)
    logger.info(f"evaluation: {len(tasks)} task(s) ({', '.join(t.name for t in tasks)}), {len(requests)} requests in "
                f"{len(batches)} forward(s) of {ev.batch_size} x {seq_len} per data-parallel rank, every "
                f"{ev.eval_every or '-'} steps{' and at the end' if ev.at_end else ''}")
    return TaskEvaluator(tasks, requests, seq_len, batches, FlashGPTLMLoss(cross_entropy), ev.eval_every, ev.at_end,
                         group=dims.group("pp_dp"), device=device,
                         details_path=run_dir / "eval_details.jsonl" if rank == 0 else None)
