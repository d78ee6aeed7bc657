"""The async checkpoint's staging buffer (checkpoint/staging.py): one host allocation of the plan's exact size (no
per-tensor blocks, no power-of-two rounding), pinned once in place when the state is on a GPU, reused by later saves.
Pinning needs CUDA: here the pinner is a recorder, and the decision (whether, what, how often) is what is tested."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from internlm_core.checkpoint.staging import ALIGN, ReusingCPUStager, StagingPlan


def state(scale: float = 1.0) -> dict:
    return {"model": {"w": torch.full((3, 5), scale), "b": torch.arange(7, dtype=torch.bfloat16) * scale},
            "optimizer": {"state": {"w": {"step": torch.tensor(4.0 * scale), "exp_avg": torch.ones(3, 5) * scale}},
                          "param_groups": [{"lr": 0.1 * scale, "params": ["w"]}]},
            "empty": torch.zeros(0, 4), "flags": [torch.tensor([True, False]), "note"], "step": int(scale)}


def in_buffer(t: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = t.untyped_storage().data_ptr()
    return start == buffer.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= start + buffer.numel()


class RecordingPinner:
    def __init__(self):
        self.pinned: list[tuple[int, int]] = []
        self.unpinned = 0

    def __call__(self, buffer: torch.Tensor):
        self.pinned.append((buffer.data_ptr(), buffer.numel()))

        def unpin():
            self.unpinned += 1
        return unpin


def test_the_plan_lays_every_tensor_out_at_aligned_offsets_of_one_buffer():
    plan = StagingPlan.of(state())
    sizes = [15 * 4, 7 * 2, 4, 15 * 4, 0, 2]  # w, b, step, exp_avg, empty, flags, in visiting order
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // ALIGN) * ALIGN
    assert plan.offsets == (0, 512, 1024, 1536, 2048, 2048) == tuple(offsets) and plan.nbytes == end == 5 * ALIGN
    assert not plan.from_device


def test_one_allocation_reused_by_the_next_save():
    stager = ReusingCPUStager()
    first = stager.stage(state(1.0))
    buffer = stager.buffer
    assert stager.allocations == 1 and buffer.numel() == StagingPlan.of(state()).nbytes
    staged = [first["model"]["w"], first["model"]["b"], first["optimizer"]["state"]["w"]["step"],
              first["optimizer"]["state"]["w"]["exp_avg"], first["flags"][0]]
    assert all(in_buffer(t, buffer) for t in staged)
    assert torch.equal(first["model"]["b"], torch.arange(7, dtype=torch.bfloat16))
    assert first["optimizer"]["param_groups"] == [{"lr": 0.1, "params": ["w"]}] and first["flags"][1] == "note"
    assert first["empty"].shape == (0, 4) and first["optimizer"]["state"]["w"]["step"].shape == ()

    second = stager.stage(state(2.0))
    assert stager.allocations == 1 and stager.buffer is buffer  # the same memory, the new values
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()
    assert torch.equal(second["model"]["w"], torch.full((3, 5), 2.0)) and second["step"] == 2
    assert second["optimizer"]["state"]["w"]["step"].item() == 8.0 and not stager.pinned


def test_a_grown_state_gets_a_new_buffer_a_smaller_one_keeps_it():
    stager = ReusingCPUStager()
    stager.stage(state())
    bigger = {**state(), "extra": torch.ones(1000)}
    stager.stage(bigger)
    assert stager.allocations == 2 and stager.buffer.numel() == StagingPlan.of(bigger).nbytes
    small = stager.stage({"w": torch.ones(2)})
    assert stager.allocations == 2 and in_buffer(small["w"], stager.buffer)


def test_pinned_once_in_place_and_unpinned_on_close():
    pinner = RecordingPinner()
    stager = ReusingCPUStager(pin=True, pinner=pinner)
    stager.stage(state())
    stager.stage(state(3.0))
    assert pinner.pinned == [(stager.buffer.data_ptr(), StagingPlan.of(state()).nbytes)] and stager.pinned
    stager.close()
    assert pinner.unpinned == 1 and stager.buffer is None and not stager.pinned


def test_a_host_state_is_not_pinned_unless_asked():
    pinner = RecordingPinner()
    ReusingCPUStager(pinner=pinner).stage(state())  # pin=None: only a state on a GPU is worth pinning
    assert pinner.pinned == []


@pytest.fixture
def mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_a_dtensor_is_staged_as_its_shard_with_its_placements(mesh):
    w = distribute_tensor(torch.arange(12.0).view(4, 3), mesh, [Shard(0)])
    stager = ReusingCPUStager()
    staged = stager.stage({"w": w})["w"]
    assert isinstance(staged, DTensor) and staged.placements == (Shard(0),) and staged.shape == (4, 3)
    assert in_buffer(staged.to_local(), stager.buffer) and torch.equal(staged.full_tensor(), w.full_tensor())
