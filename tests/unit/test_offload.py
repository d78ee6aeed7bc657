"""model.offload_activations (issue 38 item 4) on the CPU: gradients bitwise equal with and without the offload
(fp32, also under activation checkpointing), every saved tensor of the blocks above the threshold moved (counted by
a saved-tensors hook of the test's own), and the CUDA path's order of copies, events and record_stream checked
with a recorder standing in for the streams."""

from __future__ import annotations

import pytest
import torch

from internlm_core.model import build_model
from internlm_core.parallel import checkpoint_and_compile
from internlm_core.parallel.offload import MIN_BYTES, HostOps, Offloader, check_offload, is_parameter, offload_blocks
from tests.unit.test_model import small_cfg


def _cfg():
    return small_cfg(num_layers=4, hidden_size=64, vocab_size=97)


def _model(state, checkpoint=False, offload=False, min_bytes=MIN_BYTES):
    model = build_model(_cfg())
    model.load_state_dict(state)
    blocks = list(model.layers.values())
    checkpoint_and_compile(blocks, checkpoint, compile=False)
    offloader = offload_blocks(blocks, torch.device("cpu"), min_bytes) if offload else None
    return model, offloader


def _ids():
    return torch.randint(0, 97, (8, 32), generator=torch.Generator().manual_seed(1))


def _grads(model):
    model(_ids()).float().pow(2).mean().backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("checkpoint", [False, "full", "selective"])
def test_gradients_bitwise_equal_with_and_without_offload(checkpoint):
    torch.manual_seed(0)
    state = build_model(_cfg()).state_dict()
    ref = _grads(_model(state, checkpoint)[0])
    model, offloader = _model(state, checkpoint, offload=True)
    got = _grads(model)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    s = offloader.stats
    assert s.offloaded > 0 and s.unpacks >= s.offloaded and s.fetched_groups == 1
    assert s.prefetched_groups == 3  # the last block is fetched when backward reaches it, each other one prefetched
    if checkpoint == "full":  # the checkpoint saves only each block's inputs: hidden states (8 x 32 x 64 fp32, 64 KiB)
        # and the rotary tables cos, sin (8 x 32 x 1 x 16, 16 KiB each)
        assert s.offloaded == 4 * 3 and s.offloaded_bytes == 4 * (8 * 32 * 64 + 2 * 8 * 32 * 16) * 4, s


class _Counter:
    """A saved-tensors hook counter: wraps a pack hook, sorting what it returns by where the tensor stays."""

    def __init__(self, pack):
        self.inner, self.device_bytes, self.host = pack, [], 0

    def __call__(self, t):
        out = self.inner(t)
        if isinstance(out, torch.Tensor):  # kept: resident on the device
            self.device_bytes.append((t.numel() * t.element_size(), is_parameter(t)))
        else:
            self.host += 1
        return out


def _saved_bytes_of_blocks(model):
    """Bytes autograd saves inside the blocks' forwards, without the offload (a plain counting hook)."""
    total = []
    for block in model.layers.values():
        def counting(*a, _f=block.forward, **k):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: total.append(t.numel() * t.element_size()) or t,
                                                          lambda t: t):
                return _f(*a, **k)
        block.forward = counting
    _grads(model)
    return sum(total)


def test_every_large_saved_tensor_is_moved():
    torch.manual_seed(0)
    state = build_model(_cfg()).state_dict()
    model, offloader = _model(state, offload=True)
    counter = offloader.pack = _Counter(offloader.pack)
    _grads(model)
    s = offloader.stats
    assert counter.host == s.offloaded + s.deduplicated and s.offloaded > 0
    assert s.packs == counter.host + len(counter.device_bytes)
    # nothing above the threshold stays on the device but the parameters (and their views)
    assert sum(b for b, param in counter.device_bytes if b >= MIN_BYTES and not param) == 0
    assert s.kept_subclass_bytes == 0
    assert _saved_bytes_of_blocks(_model(state)[0]) == (s.offloaded_bytes + s.deduplicated_bytes
                                                        + s.kept_small_bytes + s.kept_param_bytes)
    assert s.offloaded_bytes > 10 * s.kept_small_bytes  # the activations, not the bookkeeping, are what moves
    assert s.unpacks == s.packs  # every saved tensor came back once


class _Recorder(HostOps):
    """The streams and events of the CUDA path as a log of calls (streams "compute"/"side", numbered events)."""

    def __init__(self):
        self.log, self.events = [], 0

    def current_stream(self):
        return "compute"

    def side_stream(self):
        return "side"

    def record_event(self, stream):
        self.events += 1
        self.log.append(("record", stream, self.events))
        return self.events

    def wait_event(self, stream, event):
        self.log.append(("wait", stream, event))

    def record_stream(self, t, stream):
        self.log.append(("record_stream", stream))

    def to_host(self, t, stream):
        self.log.append(("d2h", stream))
        return super().to_host(t, stream)

    def to_device(self, host, device, stream):
        self.log.append(("h2d", stream))
        return super().to_device(host, device, stream)


def test_cuda_order_of_copies_events_and_streams():
    ops = _Recorder()
    off = Offloader(ops, min_bytes=16)
    x = torch.randn(4, 8, requires_grad=True)
    with off.block(0):
        a = (x * 2).sin()          # saves x*2 (mul by a python scalar saves nothing)
    with off.block(1):
        b = (a * 3).sin()
    forward = list(ops.log)
    # each pack: an event on compute, the side stream waits for it, copies, keeps t's memory for itself, an event
    assert forward == [("record", "compute", 1), ("wait", "side", 1), ("d2h", "side"), ("record_stream", "side"),
                       ("record", "side", 2),
                       ("record", "compute", 3), ("wait", "side", 3), ("d2h", "side"), ("record_stream", "side"),
                       ("record", "side", 4)]
    ops.log.clear()
    b.sum().backward()
    # block 1 first: its copy back after its copy out (event 4), then block 0 prefetched (after event 2) before
    # block 1's tensor is handed out; the compute stream waits for that tensor's copy back and keeps its memory
    assert ops.log[:6] == [("wait", "side", 4), ("h2d", "side"), ("record", "side", 5),
                           ("wait", "side", 2), ("h2d", "side"), ("record", "side", 6)]
    assert ops.log[6:] == [("wait", "compute", 5), ("record_stream", "compute"),
                           ("wait", "compute", 6), ("record_stream", "compute")]
    assert off.stats.fetched_groups == 1 and off.stats.prefetched_groups == 1
    assert torch.equal(x.grad, ((x * 2).sin() * 3).cos() * 3 * (x * 2).cos() * 2)


def test_a_new_forward_pass_does_not_prefetch_into_the_previous_one():
    off = Offloader(HostOps(), min_bytes=16)
    x = torch.randn(4, 8, requires_grad=True)
    with off.block(0):
        a = (x * 2).sin()
    with off.block(0):  # the next micro-batch's first block: no link to the previous pass
        b = (x * 3).sin()
    with off.block(1):
        c = (b * 3).sin()
    (a.sum() + c.sum()).backward()
    assert off.stats.fetched_groups == 2 and off.stats.prefetched_groups == 1


def test_every_layout_composes():
    check_offload(False, tensor=2, pipeline=2, compile=True)
    check_offload(True, tensor=2, pipeline=2, compile=True)  # tensor parallel's DTensors move their local tensors


def test_estimator_counts_two_blocks_on_the_device():
    """Every block's activations on the host; in backward two blocks' worth on the device (the one in backward and
    the one prefetched), after the head's and the loss's tensors are gone: what exceeds them counts."""
    from internlm_core.config import load_config
    from internlm_core.estimate import estimate
    off = load_config("configs/7B.py", ["model.offload_activations=True"])
    on = load_config("configs/7B.py", ["model.offload_activations=False"])
    a, b = estimate(off, 8), estimate(on, 8)
    tokens, tb = on.data.seq_len * on.data.micro_bsz, a.token_bytes
    block = tb.block * tokens
    fetched = max(0.0, 2 * block - tokens * tb.head - a.memory.loss_peak)
    assert b.memory.activations - a.memory.activations == pytest.approx(
        on.model.num_layers * block - fetched, rel=1e-6), (a.memory.activations, b.memory.activations)
    assert a.memory.host_offload == pytest.approx(on.model.num_layers * block) and b.memory.host_offload == 0
    assert any("activation offload" in n for n in a.notes)


def test_a_block_waits_for_the_copies_out_of_the_block_two_before():
    ops = _Recorder()
    off = Offloader(ops, min_bytes=16)
    h = torch.randn(4, 8, requires_grad=True)
    for i in range(4):
        ops.log.append(("enter", i))
        with off.block(i):
            h = (h * 2).sin().sin()  # two saved tensors per block: copy-out events 2 and 4 in block 0
    entries = [ops.log.index(("enter", i)) for i in range(4)]
    assert [e for e in ops.log[entries[0]:entries[2]] if e[0] == "wait" and e[1] == "compute"] == []
    # block 2 starts after block 0's last copy out (event 4), block 3 after block 1's (event 8)
    assert ops.log[entries[2] + 1] == ("wait", "compute", 4) and ops.log[entries[3] + 1] == ("wait", "compute", 8)
    h.sum().backward()


@pytest.mark.slow
def test_compiled_blocks_bitwise_equal_with_offload():
    """model.compile's blocks: the compiled backward asserts the saved tensors' strides, which the copies keep."""
    torch.manual_seed(0)
    state = build_model(_cfg()).state_dict()

    def grads(offload):
        model = build_model(_cfg())
        model.load_state_dict(state)
        blocks = list(model.layers.values())[:2]
        checkpoint_and_compile(blocks, False, compile=True)
        offloader = offload_blocks(blocks, torch.device("cpu")) if offload else None
        return _grads(model), offloader
    ref, _ = grads(False)
    got, offloader = grads(True)
    assert offloader.stats.offloaded > 0 and all(torch.equal(a, b) for a, b in zip(got, ref))


def test_a_tensor_saved_twice_in_one_block_is_copied_once():
    ops = _Recorder()
    off = Offloader(ops, min_bytes=16)
    x = torch.randn(4, 8, requires_grad=True)
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    with off.block(0):
        h = x.sin()
        out = (h @ w1).sum() + (h @ w2).sum()  # both matmuls save h (and their weights, small here)
    assert off.stats.deduplicated == 1 and ops.log.count(("d2h", "side")) == off.stats.offloaded
    out.backward()
    grad, x.grad = x.grad, None
    h = x.sin()
    ((h @ w1).sum() + (h @ w2).sum()).backward()  # without the hooks
    assert torch.equal(grad, x.grad)


class _NumpyHost(HostOps):
    """The host copies as numpy arrays, which LiveTensorBytes (torch's storages) does not see: on the CPU the live
    torch tensors then are what a GPU would hold."""

    def to_host(self, t, stream):
        return t.detach().numpy().copy()  # the tests' tensors are contiguous

    def to_device(self, host, device, stream):
        return torch.from_numpy(host).clone()


def test_device_peak_drops_by_more_than_a_block():
    """4 blocks, no checkpointing: the peak of live device tensors (measured: 6.77 MB -> 4.25 MB) falls by more than
    one block's saved bytes (1.67 MB); under backward the device holds the block in backward and the prefetched one."""
    from tests.helpers.live_tensors import LiveTensorBytes
    torch.manual_seed(0)
    state = build_model(_cfg()).state_dict()
    peaks, stats = [], None
    for offload in (False, True):
        model, offloader = _model(state, offload=offload)
        if offloader is not None:
            offloader.ops, stats = _NumpyHost(), offloader.stats
        with LiveTensorBytes(exclude=list(model.parameters())) as live:
            _grads(model)
        peaks.append(live.peak)
    per_block = stats.offloaded_bytes / 4  # distinct bytes copied out per block
    assert peaks[0] - peaks[1] > per_block, (peaks, per_block)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_dtensors_move_their_local_tensors(sequence_parallel):
    """A tensor-parallel model (the family's plan over a one-rank mesh: every matmul saves DTensors): gradients
    bitwise equal with and without the offload, and what stays on the device is parameters and small tensors only
    (the DTensors' local tensors moved, rebuilt around their copies in backward)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from internlm_core.model.internlm.parallelize import apply_tensor_parallel
    from internlm_core.model.spec import TensorParallelOptions

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        state = build_model(_cfg()).state_dict()
        grads = []
        for offload in (False, True):
            model = build_model(_cfg())
            model.load_state_dict(state)
            apply_tensor_parallel(model, mesh, TensorParallelOptions(sequence_parallel=sequence_parallel))
            offloader = offload_blocks(list(model.layers.values()), torch.device("cpu")) if offload else None
            logits = model(_ids())
            (logits.full_tensor() if isinstance(logits, DTensor) else logits).float().pow(2).mean().backward()
            grads.append([p.grad.full_tensor() for p in model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*grads))
        s = offloader.stats
        assert s.offloaded > 0 and s.kept_subclass_bytes == 0 and s.unpacks == s.packs
        assert s.offloaded_bytes > 10 * s.kept_small_bytes
    finally:
        dist.destroy_process_group()
