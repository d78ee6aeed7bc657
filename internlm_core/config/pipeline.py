"""parallel.pipeline_schedule: which torch.distributed.pipelining schedule runs the stages, and what each needs.

- "1f1b": one stage per rank (Schedule1F1B); "interleaved": model.num_chunks > 1 stages per rank in loop order
  (stage r, r + pipeline, ...; ScheduleInterleaved1F1B). "auto" (default): 1f1b with one chunk, else interleaved.
- "interleaved_zb": the zero-bubble ZB1P schedule (ScheduleInterleavedZeroBubble), loop order, any model.num_chunks
  (one chunk: ZB-H1). The backward is split into an input-gradient pass (I) and a weight-gradient pass (W) that
  fills the bubbles.
- "zbv" (ScheduleZBVZeroBubble) and "dualpipev" (ScheduleDualPipeV, DeepSeek's DualPipe on a V): split backward too,
  exactly two stages per rank in V order (rank r runs stages r and 2 * pipeline - 1 - r, so rank 0 holds the
  embedding and the head): model.num_chunks = 2. dualpipev needs data.micro_num >= 2 * pipeline.

The split-backward schedules refuse model.compile: torch compiles the in-place `block.compile()` blocks' backward as
one graph that computes input and weight gradients together, which the input-only pass cannot split; torch refuses
compiled stage modules only when they are OptimizedModule wrappers, and with in-place compiled blocks these
schedules failed or gave wrong weight gradients silently (issue 38; interleaved 1F1B was correct).
"""

from __future__ import annotations

from ..errors import ConfigError

SCHEDULES = ("auto", "1f1b", "interleaved", "interleaved_zb", "zbv", "dualpipev")
SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")  # backward split into input (I) and weight (W) passes
V_SHAPED = ("zbv", "dualpipev")  # two stages per rank: r and 2 * pipeline - 1 - r


def resolve_schedule(schedule: str, num_chunks: int) -> str:
    """The schedule `parallel.pipeline_schedule` names ("auto": 1f1b with one chunk per rank, else interleaved)."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.pipeline_schedule: expected one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if schedule == "auto":
        return "1f1b" if num_chunks == 1 else "interleaved"
    return schedule


def stage_ids(schedule: str, pp_rank: int, pp_size: int, num_chunks: int) -> list[int]:
    """The virtual stages pipeline rank `pp_rank` runs: r, r + pipeline, ... (loop order), or r and
    2 * pipeline - 1 - r under the V schedules."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + c * pp_size for c in range(num_chunks)]


def check_pipeline_schedule(schedule: str, pipeline: int, num_chunks: int, micro_num: int, compile: bool,
                            origin: str = "") -> str:
    """The resolved schedule, or ConfigError naming the key that does not fit it (module docstring); `origin`: the
    user's key the schedule was mapped from (InternEvo's zero_bubble), named in the error too."""
    name = resolve_schedule(schedule, num_chunks)
    key = f"parallel.pipeline_schedule={schedule!r}" + (f" (from {origin})" if origin else "")
    if pipeline == 1:
        if schedule != "auto":
            raise ConfigError(f"{key}: needs parallel.pipeline > 1 (there is no pipeline to schedule)")
        return name
    if name == "1f1b" and num_chunks != 1:
        raise ConfigError(f"{key} runs one stage per rank: model.num_chunks must be 1, got {num_chunks} "
                          f"(use 'interleaved' or 'interleaved_zb')")
    if name == "interleaved" and num_chunks == 1:
        raise ConfigError(f"{key} needs model.num_chunks > 1 stages per rank, got 1 (use '1f1b')")
    if name in V_SHAPED and num_chunks != 2:
        raise ConfigError(f"{key} runs exactly two stages per rank in V order: model.num_chunks must be 2, "
                          f"got {num_chunks}")
    if name == "dualpipev" and micro_num < 2 * pipeline:
        raise ConfigError(f"{key} needs data.micro_num >= 2 * parallel.pipeline ({2 * pipeline} stages), "
                          f"got {micro_num}")
    if name in SPLIT_BACKWARD and compile:
        raise ConfigError(f"{key} with model.compile=True: the compiled blocks' backward is one graph computing input "
                          f"and weight gradients together, which this schedule's split backward (input pass, then "
                          f"weight pass) gets wrong silently (issue 38); use '1f1b' / 'interleaved' or "
                          f"model.compile=False")
    return name


def check_split_backward(name: str, checkpoint_policy: str) -> None:
    """ConfigError for selective checkpointing under a split-backward schedule (found by issue 38's held-out checks:
    the weight pass recomputes a block a second time, whose saved ops served one: torch's "backward an extra
    time"). The fused head's refusal there is config/recompute.fused_head_of's."""
    if name in SPLIT_BACKWARD and checkpoint_policy == "selective":
        raise ConfigError(f"model.checkpoint='selective' with parallel.pipeline_schedule={name!r}: the weight pass "
                          f"recomputes each block again and selective checkpointing's saved ops serve one recompute; "
                          f"use model.checkpoint=True (or a fraction) or a '1f1b' / 'interleaved' schedule")


def zero_bubble_schedule(num_chunks: int) -> str:
    """InternEvo's parallel.pipeline=dict(zero_bubble=True): its ZB-H1 schedule with one chunk per rank (here
    "interleaved_zb", torch's ZB1P, which is ZB-H1 on one stage per rank), its V-shape schedule with two ("zbv")."""
    if num_chunks == 1:
        return "interleaved_zb"
    if num_chunks == 2:
        return "zbv"
    raise ConfigError(f"parallel.pipeline.zero_bubble=True: InternEvo's zero-bubble schedules run model.num_chunks "
                      f"1 (ZB-H1) or 2 (ZB-V), got {num_chunks}; set parallel.pipeline_schedule='interleaved_zb' "
                      f"for more chunks")
