"""Training and validation metrics: AccPerplex (accuracy, perplexity, per dataset type) and throughput/MFU."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from .utils import collectives


class AccPerplex:
    """Token accuracy and perplexity, overall and per dataset type (from `type_ids`).

    Accumulates sums over micro-batches (and ranks, via `process_group`) until `get_metric()` resets.
    ppl = exp(sum of token cross entropies / number of tokens), tokens with label -100 excluded.
    """

    def __init__(self, type_names: Optional[dict[int, str]] = None, process_group: Optional[dist.ProcessGroup] = None,
                 max_types: int = 64):
        self.type_names = dict(type_names or {})
        self.process_group = process_group
        self.max_types = max_types
        self.reset()

    def reset(self) -> None:
        # [right, tokens, loss_sum] per type id; index max_types-1 is unused overflow guard
        self._sums: Optional[torch.Tensor] = None

    @torch.no_grad()
    def update(self, logits: torch.Tensor, labels: torch.Tensor, type_ids: Optional[torch.Tensor] = None,
               token_losses: Optional[torch.Tensor] = None, predictions: Optional[torch.Tensor] = None) -> None:
        """logits [..., V], labels [...], type_ids like labels; token_losses: per-token CE and predictions: the
        argmax of the logits, if already computed (the loss does both on CPU)."""
        logits = logits.reshape(-1, logits.shape[-1])
        labels = labels.reshape(-1)
        if token_losses is None and not isinstance(logits, DTensor):  # label smoothing: the plain cross entropy
            token_losses, argmax = cross_entropy_and_argmax(logits, labels)
            predictions = argmax if predictions is None else predictions
        elif token_losses is None:  # vocabulary-sharded logits, under loss_parallel: replicated per-token losses
            token_losses = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="none")
            if isinstance(token_losses, DTensor):
                token_losses = token_losses.full_tensor()
        valid = labels != -100
        pred = vocab_parallel_argmax(logits) if predictions is None else predictions.reshape(-1)
        right = (pred == labels) & valid
        types = (type_ids.reshape(-1) if type_ids is not None else torch.zeros_like(labels)).clamp(0, self.max_types - 1)
        types = types.to(labels.device)
        stats = torch.stack([right.float(), valid.float(), token_losses.reshape(-1).float() * valid])  # [3, N]
        sums = torch.zeros(3, self.max_types, dtype=torch.float64, device=labels.device)
        sums.index_add_(1, types, stats.double())
        self._sums = sums if self._sums is None else self._sums + sums

    def reduced_sums(self) -> torch.Tensor:
        """The [3, max_types] float64 sums (right, tokens, loss per type) summed over the group, on the device (no
        host read; `get_metric(sums=...)` turns them, read on the host, into the metrics)."""
        shared = self.process_group is not None and collectives.dist_ready()
        if self._sums is None:  # no micro-batch here (a pipeline stage without outputs): zeros, on the group's device
            sums = torch.zeros(3, self.max_types, dtype=torch.float64,
                               device=collectives.group_device(self.process_group) if shared else None)
        else:
            sums = self._sums.clone() if shared else self._sums
        if shared:
            collectives.all_reduce(sums, group=self.process_group)
        return sums

    def get_metric(self, reset: bool = True, sums: Optional[torch.Tensor] = None) -> dict[str, float]:
        """{"acc", "ppl", "tokens", "loss_from_metric", "acc/{type}", "loss/{type}", "ppl/{type}"} summed over ranks;
        from `sums` when given (`reduced_sums()` already read on the host), else reduced and read here."""
        sums = (self.reduced_sums() if sums is None else sums).cpu()
        right, tokens, loss = sums[0], sums[1], sums[2]
        total = tokens.sum().item()
        out = {"tokens": total}
        if total > 0:
            mean_loss = loss.sum().item() / total
            out.update(acc=right.sum().item() / total, loss_from_metric=mean_loss, ppl=_safe_exp(mean_loss))
        for t in torch.nonzero(tokens > 0).flatten().tolist():
            name = self.type_names.get(t, str(t))
            n = tokens[t].item()
            out[f"acc/{name}"] = right[t].item() / n
            out[f"loss/{name}"] = loss[t].item() / n
            out[f"ppl/{name}"] = _safe_exp(loss[t].item() / n)
        if reset:
            self.reset()
        return out


# fp32 bytes of one chunk of `cross_entropy_and_argmax`: on a CPU it stays in the caches, on a GPU it is a few
# large kernels; either way far below the [tokens, V] fp32 copy of the logits it replaces
_CHUNK_BYTES = {"cpu": 4 << 20, "cuda": 128 << 20}


@torch.no_grad()
def cross_entropy_and_argmax(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross entropy (fp32, 0 where the label is -100) and argmax of [N, V] logits, a chunk of rows at a
    time: no fp32 [N, V] tensor (under label smoothing the loss returns no plain per-token cross entropy, and
    F.cross_entropy(logits.float()) held two such buffers, ~3.4 GB for 7B at the activation peak)."""
    n, v = logits.shape
    losses = torch.empty(n, dtype=torch.float32, device=logits.device)
    argmax = torch.empty(n, dtype=torch.long, device=logits.device)
    step = max(1, _CHUNK_BYTES.get(logits.device.type, _CHUNK_BYTES["cuda"]) // (4 * v))
    for s in range(0, n, step):  # row by row the same values as on the whole: no row depends on another
        x = logits[s:s + step].float()
        argmax[s:s + step] = x.argmax(dim=-1)
        losses[s:s + step] = F.cross_entropy(x, labels[s:s + step], ignore_index=-100, reduction="none")
    return losses, argmax


@torch.no_grad()
def vocab_parallel_argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension; for a DTensor sharded along it (vocabulary-parallel logits) without
    gathering the logits: each rank's best (value, global index), all-gathered, first maximum wins (as argmax)."""
    if not isinstance(logits, DTensor):
        return logits.argmax(dim=-1)
    dims = [i for i, p in enumerate(logits.placements) if isinstance(p, Shard) and p.dim in (-1, logits.ndim - 1)]
    if len(dims) != 1 or any(not p.is_replicate() for i, p in enumerate(logits.placements) if i != dims[0]):
        return logits.full_tensor().argmax(dim=-1)
    mesh = logits.device_mesh
    local = logits.to_local()
    n = mesh.size(dims[0])
    if logits.shape[-1] % n:  # uneven shards: offsets are not rank * width
        return logits.full_tensor().argmax(dim=-1)
    values, index = local.float().max(dim=-1)
    index = index + mesh.get_local_rank(dims[0]) * local.shape[-1]
    group = mesh.get_group(dims[0])
    all_values = [torch.empty_like(values) for _ in range(n)]
    all_index = [torch.empty_like(index) for _ in range(n)]
    collectives.all_gather(all_values, values.contiguous(), group=group)
    collectives.all_gather(all_index, index.contiguous(), group=group)
    best = torch.stack(all_values).argmax(dim=0, keepdim=True)  # lowest rank among equal maxima
    return torch.stack(all_index).gather(0, best).squeeze(0)


def _safe_exp(x: float) -> float:
    return math.exp(x) if x < 700 else float("inf")


class Throughput:
    """Per-step tokens/s per device (InternLM's tgs), achieved TFLOPS per device and MFU.

    FLOPs per token come from `model.flops_per_token` (6*N + 12*L*h*s); the peak is per device and
    per dtype (see utils/peak.py), None when unknown — then MFU is reported as None, never guessed.
    """

    def __init__(self, flops_per_token: int, world_size: int, peak_flops: Optional[float]):
        self.flops_per_token = flops_per_token
        self.world_size = world_size
        self.peak_flops = peak_flops

    def compute(self, tokens: int, seconds: float) -> dict[str, Optional[float]]:
        """`tokens` trained by the whole job in `seconds`."""
        tgs = tokens / max(seconds, 1e-9) / self.world_size
        flops = tgs * self.flops_per_token
        return {"tgs": tgs, "tflops": flops / 1e12,
                "mfu": (flops / self.peak_flops) if self.peak_flops else None}
