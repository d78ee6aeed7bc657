"""What an MoE layer reports about its routing: one forward's `MoEStats`, and their sum over a step's micro-batches.

Every value is a detached tensor on the layer's device (no host sync in the forward); a metrics writer calls
`.item()` / `.tolist()` when it logs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .router import Routing


@dataclass(frozen=True)
class MoEStats:
    """One MoE layer's routing on THIS rank.

    tokens_per_expert [E] int64: the (token, choice) pairs this rank's router sent to each global expert, every
        one of the top_k choices, BEFORE capacity dropping (sum it over the data-parallel group for the global load;
        under expert parallel the count is still by router, not by the rank that computed the expert).
    dropped_fraction: dropped pairs / (tokens * top_k), 0 for Dropless and drop_tokens=False.
    aux_loss / z_loss: l_aux and l_z without their coefficients (fp32 scalars).
    capacity: the per-expert capacity of the forward (None when unbounded). num_tokens: tokens routed.
    """

    tokens_per_expert: torch.Tensor
    dropped_fraction: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    capacity: Optional[int]
    num_tokens: int


def stats_of(routing: Routing) -> MoEStats:
    """The detached MoEStats of one forward's routing."""
    S, k = routing.experts.shape
    with torch.no_grad():
        if routing.keep is None:
            dropped = torch.zeros((), dtype=torch.float32, device=routing.experts.device)
        else:
            dropped = 1.0 - routing.keep.sum().float() / max(S * k, 1)
        return MoEStats(routing.tokens_per_expert.detach().clone(), dropped, routing.l_aux.detach().float(),
                        routing.l_z.detach().float(), routing.capacity, S)


class StatsAccumulator:
    """The sum of a step's forwards: tokens per expert summed, the dropped fraction over all pairs, the losses
    averaged over forwards. `pop()` returns the step's MoEStats (None when no forward ran) and starts anew."""

    def __init__(self) -> None:
        self._tokens: Optional[torch.Tensor] = None
        self._dropped_pairs = self._pairs = self._aux = self._z = None
        self._forwards = 0
        self._num_tokens = 0
        self._capacity: Optional[int] = None

    def add(self, stats: MoEStats, top_k: int) -> None:
        pairs = stats.num_tokens * top_k
        dropped_pairs = stats.dropped_fraction * pairs
        if self._tokens is None:
            self._tokens, self._dropped_pairs = stats.tokens_per_expert.clone(), dropped_pairs
            self._aux, self._z = stats.aux_loss.clone(), stats.z_loss.clone()
            self._pairs = 0
        else:
            self._tokens += stats.tokens_per_expert
            self._dropped_pairs = self._dropped_pairs + dropped_pairs
            self._aux, self._z = self._aux + stats.aux_loss, self._z + stats.z_loss
        self._pairs += pairs
        self._forwards += 1
        self._num_tokens += stats.num_tokens
        self._capacity = stats.capacity

    def pop(self) -> Optional[MoEStats]:
        if self._tokens is None:
            return None
        n = self._forwards
        out = MoEStats(self._tokens, self._dropped_pairs / max(self._pairs, 1), self._aux / n, self._z / n,
                       self._capacity, self._num_tokens)
        self.__init__()
        return out
