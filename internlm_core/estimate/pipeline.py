"""The pipeline's bubble and in-flight micro-batches, read from the schedule's own action lists.

torch's runtime schedules build every rank's list of compute actions (`pipeline_order`: forward F, full backward B,
input-gradient backward I, weight-gradient backward W, DualPipeV's overlapped F + B) when constructed; no process
group is needed (`_stage` stands in for a PipelineStage). `profile` simulates those lists with unit times (F 1,
B 2, I 1, W 1: a backward costs two forwards, split evenly between I and W) and zero-cost sends: each action starts
when its rank is free and its inputs exist (F after the previous stage's F of the micro-batch, B / I after the next
stage's B / I, or the stage's own F on the last stage; W after its I). Figures per rank:

- busy: the compute the rank does; idle = makespan - busy (the bubble). Under 1F1B (p - 1) / (m + p - 1) of the
  makespan is idle on every rank; interleaved over v chunks (p - 1) / (v * m + p - 1).
- in_flight: the most micro-batches whose activations the rank holds at once, counted from a stage's F to its
  B (or W: the weight pass still needs the saved inputs), in units of the rank's whole share of layers (a stage of
  v chunks counts 1 / v). 1F1B's first rank: min(p, m).
- warmup: the forwards the rank runs before its first backward.

"1f1b" runs torch's Schedule1F1B, which keeps no runtime action list (2.13's `_get_pipeline_order` is a drawing
with an off-by-one on the last rank; 2.11 has none): its list is written here from Schedule1F1B's own loop
(`_one_f_one_b`: min(m, p - r) warm-up forwards on rank r, then backward / forward pairs, then the backwards left).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

UNIT_TIMES = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class PipelineProfile:
    """One schedule's simulated step (module docstring); tuples indexed by pipeline rank."""

    schedule: str
    pp: int
    num_chunks: int
    micro_num: int
    makespan: float
    busy: tuple[float, ...]
    in_flight: tuple[float, ...]
    warmup: tuple[int, ...]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the step on the idlest rank: (makespan - busy) / makespan."""
        return 1.0 - min(self.busy) / self.makespan

    @property
    def bubble_ratio(self) -> float:
        """Idle time over compute time on the busiest rank: the step takes (1 + this) times its compute."""
        return self.makespan / max(self.busy) - 1.0


def _stage(stage_index: int, num_stages: int, pp: int) -> SimpleNamespace:
    """What torch's schedule constructors read of a stage (no module runs: an empty Sequential)."""
    import torch.nn as nn
    return SimpleNamespace(stage_index=stage_index, num_stages=num_stages, group_size=pp, group_rank=0,
                           submod=nn.Sequential(), is_first=stage_index == 0, is_last=stage_index == num_stages - 1)


def action_lists(schedule: str, pp: int, num_chunks: int, micro_num: int) -> dict[int, list[tuple[str, int, int]]]:
    """{rank: [(kind, stage, micro-batch), ...]} of torch's schedule, in order, compute only (kinds F, B, I, W;
    DualPipeV's overlapped pair as its F then its B)."""
    if schedule == "1f1b":
        return _one_f_one_b(pp, micro_num)
    from ..config.pipeline import stage_ids
    from ..parallel.pipeline import SCHEDULE_CLASSES  # torch.distributed.pipelining: imported when asked
    stages = [_stage(s, pp * num_chunks, pp) for s in stage_ids(schedule, 0, pp, num_chunks)]
    order = SCHEDULE_CLASSES[schedule](stages, micro_num).pipeline_order
    out: dict[int, list[tuple[str, int, int]]] = {}
    for rank, actions in order.items():
        flat = []
        for a in actions:
            if a is None:
                continue
            for sub in (a.sub_actions or (a,)):
                kind = sub.computation_type.value
                if kind in UNIT_TIMES:
                    flat.append((kind, sub.stage_index, sub.microbatch_index))
        out[rank] = flat
    return out


def _one_f_one_b(pp: int, micro_num: int) -> dict[int, list[tuple[str, int, int]]]:
    """Schedule1F1B's order (torch's `_step_microbatches`): rank r runs w = min(m, p - r) forwards, then
    backward i and forward w + i while forwards are left, then the remaining backwards."""
    out = {}
    for r in range(pp):
        w = min(micro_num, pp - r)
        actions = [("F", r, i) for i in range(w)]
        for i in range(micro_num - w):
            actions += [("B", r, i), ("F", r, w + i)]
        out[r] = actions + [("B", r, i) for i in range(micro_num - w, micro_num)]
    return out


def _dependency(kind: str, stage: int, mb: int, last: int) -> tuple | None:
    """The event an action waits for (module docstring); None: none."""
    if kind == "F":
        return ("F", stage - 1, mb) if stage > 0 else None
    if kind in ("B", "I"):
        return ("G", stage + 1, mb) if stage < last else ("F", stage, mb)
    return ("G", stage, mb)  # W: after the stage's own input gradient


def simulate(lists: dict[int, list[tuple[str, int, int]]], num_stages: int,
             times: dict[str, float] = UNIT_TIMES) -> tuple[float, list[float]]:
    """(makespan, busy time per rank) of the action lists run with `times` (module docstring)."""
    done: dict[tuple, float] = {}
    clock, pos = [0.0] * len(lists), [0] * len(lists)
    remaining = sum(len(v) for v in lists.values())
    while remaining:
        progressed = False
        for rank, actions in lists.items():
            while pos[rank] < len(actions):
                kind, stage, mb = actions[pos[rank]]
                dep = _dependency(kind, stage, mb, num_stages - 1)
                if dep is not None and dep not in done:
                    break
                end = max(clock[rank], done.get(dep, 0.0)) + times[kind]
                clock[rank] = end
                done[("F" if kind == "F" else "W" if kind == "W" else "G", stage, mb)] = end
                pos[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [lists[r][pos[r]] for r in lists if pos[r] < len(lists[r])]
            raise RuntimeError(f"pipeline schedule simulation: no action can run, next ones {stuck}")
    busy = [sum(times[k] for k, _, _ in lists[r]) for r in sorted(lists)]
    return max(clock), busy


def _held(actions: list[tuple[str, int, int]], num_chunks: int) -> tuple[float, int]:
    """(the most micro-batch stages holding activations at once / num_chunks, forwards before the first backward)."""
    split = {(s, mb) for k, s, mb in actions if k == "W"}
    held = peak = 0
    warmup = None
    for kind, stage, mb in actions:
        if kind == "F":
            held += 1
            peak = max(peak, held)
        elif kind == "W" or (kind == "B" and (stage, mb) not in split):
            held -= 1
        if kind in ("B", "I") and warmup is None:
            warmup = sum(1 for k, _, _ in actions[:actions.index((kind, stage, mb))] if k == "F")
    return peak / num_chunks, warmup or 0


@functools.lru_cache(maxsize=64)
def profile(schedule: str, pp: int, num_chunks: int, micro_num: int) -> PipelineProfile:
    """The simulated step of `schedule` (a resolved config/pipeline.py name) on `pp` ranks of `num_chunks` stages."""
    lists = action_lists(schedule, pp, num_chunks, micro_num)
    makespan, busy = simulate(lists, pp * num_chunks)
    held = [_held(lists[r], num_chunks) for r in sorted(lists)]
    return PipelineProfile(schedule, pp, num_chunks, micro_num, makespan, tuple(busy),
                           tuple(h for h, _ in held), tuple(w for _, w in held))


def pipeline_in_flight(lay, micro_num: int, rank: int) -> float:
    """Micro-batches whose activations pipeline rank `rank` holds at its peak, in units of its share of layers
    (`profile`'s in_flight of the layout's schedule; 1 without pipeline parallel). `lay`: an estimate Layout."""
    if lay.pp == 1:
        return 1.0
    return profile(lay.pipeline_schedule, lay.pp, lay.num_chunks, micro_num).in_flight[rank]
