"""internlm_core/utils/torch_compat.py: the answers about the running torch that differ between supported versions,
and the code that acts on them (issue 33: the API scan of tests/unit/test_torch_api.py found these).

A simulated pipeline job (fake process group, static stage shapes) raised on every torch whose PipelineStage has
no `_warmup_backward_result` (2.11: no warm-up vote; 2.15: a vote it skips on a fake backend); here such a torch
is made by removing the method from the installed 2.13's PipelineStage.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.testing._internal.distributed.fake_pg import FakeStore

from internlm_core.parallel import pipeline
from internlm_core.utils import torch_compat

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import torch_api_names  # noqa: E402


@pytest.fixture
def fake_group():
    """Rank 0 of a two-rank fake process group (a simulated job's), destroyed afterwards."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _simulated_pipeline(group) -> pipeline.PipelineParallel:
    def stage_io(stage: int):
        return torch.empty(2, 4, 8, device="meta"), torch.empty(2, 4, 8, device="meta")
    return pipeline.PipelineParallel([nn.Linear(8, 8)], [0], 2, 2, group, torch.device("cpu"), stage_io=stage_io)


def test_the_vote_answer_is_what_the_installed_torchs_sources_say():
    """The run-time answer agrees with the fixture read from the same version's wheel (2.13 has the vote)."""
    version = torch.__version__.split("+")[0]
    if version not in torch_api_names.SUPPORTED:
        pytest.skip(f"torch {version} has no fixture")
    members = torch_api_names.load_fixture(version)["classes"]["torch.distributed.pipelining.PipelineStage"]
    assert torch_compat.pipeline_warmup_vote() == ("_warmup_backward_result" in members)


def test_a_simulated_pipeline_answers_the_vote_where_torch_holds_one(fake_group):
    assert torch_compat.pipeline_warmup_vote()
    assert all(type(s) is pipeline._StaticStage for s in _simulated_pipeline(fake_group).stages)


def test_a_simulated_pipeline_builds_on_a_torch_without_the_vote(fake_group, monkeypatch):
    """Before issue 33's fix: RuntimeError "PipelineStage has no warm-up vote to settle for a simulated job"."""
    monkeypatch.delattr(PipelineStage, "_warmup_backward_result")
    assert not torch_compat.pipeline_warmup_vote()
    pp = _simulated_pipeline(fake_group)
    assert all(type(s) is pipeline._Stage for s in pp.stages)
