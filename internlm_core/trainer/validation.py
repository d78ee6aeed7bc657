"""Validation during training (`data.valid_every`, the validation folders): loss, ACC and PPL of every validation
set through the evaluation forward (sharded as in training); the trainer's `evaluate` calls it and records the
result. Also the evaluation forward itself, which the task evaluator (evaluation.py) shares."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Mapping, Optional

import torch

from ..loss import FlashGPTLMLoss
from ..metrics import AccPerplex
from ..model import document_ids_from_cu_seqlens

if TYPE_CHECKING:
    from ..parallel.pipeline import PipelineParallel  # torch.distributed.pipelining: pipeline runs only

Outputs = Callable[[dict], Iterator[tuple[torch.Tensor, dict]]]


def eval_outputs(micro_batches: list[dict], forward: Callable[[dict], torch.Tensor],
                 pipeline: Optional[PipelineParallel]) -> Iterator[tuple[torch.Tensor, dict]]:
    """(logits, micro-batch) of each micro-batch; under pipeline parallel only on the last stage."""
    if pipeline is None:
        for mb in micro_batches:
            yield forward(mb), mb
        return
    for mb in (mb for mb in micro_batches if "document_ids" not in mb):  # on the host (context parallel's own)
        mb["document_ids"] = document_ids_from_cu_seqlens(mb["cu_seqlens"], *mb["input_ids"].shape)
    yield from pipeline.forward_only(micro_batches)


def validation_metrics(loaders: Mapping[str, Iterable], outputs: Outputs,
                       contexts: Callable[[], Iterable[contextlib.AbstractContextManager]], loss_fn: FlashGPTLMLoss,
                       like: AccPerplex) -> dict[str, float]:
    """`valid/<set>/loss|acc|ppl` (and per type, when a set holds several) of every set with tokens; the metric
    is reduced like the training one (`like`: its type names and process group)."""
    results: dict[str, float] = {}
    for name, loader in loaders.items():
        metric = AccPerplex(like.type_names, like.process_group)
        for batch in loader:
            with contextlib.ExitStack() as stack:
                for ctx in contexts():
                    stack.enter_context(ctx)
                for logits, mb in outputs(batch):
                    _, side = loss_fn(logits, mb["labels"])
                    metric.update(logits, mb["labels"], mb["type_ids"], side.token_losses, side.predictions)
        m = metric.get_metric()
        if not m.get("tokens"):
            continue
        results[f"valid/{name}/loss"] = m["loss_from_metric"]
        results[f"valid/{name}/acc"] = m["acc"]
        results[f"valid/{name}/ppl"] = m["ppl"]
        per_type = {k: v for k, v in m.items() if "/" in k}
        if len(per_type) > 3:  # more than one type in this set (one type would only repeat the totals)
            results.update({f"valid/{name}/{k}": v for k, v in per_type.items()})
    return results
