"""The one place for torch names that differ between the supported torch versions (2.11 to 2.15, requirements.txt).

Outside this module the package uses only names that the oldest, the pinned and the newest supported torch all
have (tests/unit/test_torch_api.py checks every `torch.*` name the package, tools/, bench/ and train.py reach
against those versions' own sources, tests/fixtures/torch_api/*.json); a name used in here needs one of them.
Where one name exists in every supported version the package uses it directly instead of coming here: FSDP's
collectives go through `dist.all_gather_into_tensor` / `dist.reduce_scatter_tensor` (2.11 to 2.15), not 2.13's
new `all_gather_single` / `reduce_scatter_single`, which 2.11 lacks.

Each function here answers one question about the running torch by looking at it (never by its version string,
which says nothing about a nightly or a vendor build), and says which versions answer what.
"""

from __future__ import annotations

import functools
import inspect


def pipeline_warmup_vote() -> bool:
    """Whether this torch's pipeline schedules hold their warm-up vote over point-to-point sends, which a stage
    answers in `PipelineStage._warmup_backward_result` (torch 2.13 does). Torch 2.11 holds no vote; 2.15 votes
    with an all-reduce that it skips on a fake backend, where the stages' static shapes decide. A simulated job's
    fake peers deliver no send, so where this is True its stages answer the vote themselves
    (parallel/pipeline.py's `_StaticStage`); elsewhere there is nothing to answer."""
    from torch.distributed.pipelining import PipelineStage
    return hasattr(PipelineStage, "_warmup_backward_result")


@functools.lru_cache(maxsize=None)
def varlen_attn_gqa() -> dict:
    """Keyword arguments for grouped-query attention (fewer k/v heads) through
    `torch.nn.attention.varlen.varlen_attn`: torch 2.13 on asks for `enable_gqa=True` and refuses fewer k/v heads
    without it; 2.11 has no such argument and hands the heads to the FA2 kernel as they are, which groups them."""
    from torch.nn.attention.varlen import varlen_attn
    return {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}
