"""Memory report (peak per step, breakdown) and the scheduled torch.profiler trace, on CPU."""

import json
from types import SimpleNamespace

import torch

from internlm_core.monitor.memory_report import MemoryProfiler
from internlm_core.utils.memory import (optimizer_state_bytes, parameter_bytes, process_peak_rss,
                                        process_rss, tensor_bytes)
from internlm_core.monitor.profiler import TorchProfiler, build_profiler

MiB = 1024**2


def tiny_trainer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return SimpleNamespace(model=model, optimizer=opt)


def train_step(t, batch=2048):
    x = torch.randn(batch, 256)
    loss = t.model(x).pow(2).mean()
    loss.backward()
    t.optimizer.step()
    return float(loss.detach())


def test_tensor_accounting_exact():
    t = tiny_trainer()
    n_params = sum(p.numel() for p in t.model.parameters())
    assert parameter_bytes(t.model) == 4 * n_params
    assert optimizer_state_bytes(t.optimizer) == 0  # AdamW creates its state lazily
    train_step(t, batch=8)
    # exp_avg + exp_avg_sq per parameter, plus one float32 `step` scalar per parameter tensor
    assert optimizer_state_bytes(t.optimizer) == 2 * 4 * n_params + 4 * 4
    w = torch.zeros(10, 10)
    assert tensor_bytes([w, w[0], w.view(100), "not a tensor", torch.zeros(3, dtype=torch.int64)]) == 400 + 24


def _breakdown(tmp_path) -> None:
    """The measurement, in a fresh process: after another test trained in this one (the trainer keeps freed heap
    memory, as it should), a step's activations reuse pages already resident and the RSS peak cannot see them."""
    t = tiny_trainer()
    n_bytes = 4 * sum(p.numel() for p in t.model.parameters())
    mem = MemoryProfiler(tmp_path, rank=0, write_every=0)
    mem.on_train_start(t)
    for step in range(1, 4):
        train_step(t)
        mem.on_step_end(t, {"step": step})
        t.optimizer.zero_grad(set_to_none=(step == 3))  # step 3: grads freed before the next reading
    train_step(t)
    t.optimizer.zero_grad(set_to_none=True)
    mem.on_step_end(t, {"step": 4})
    mem.on_train_end(t)
    rep = json.loads((tmp_path / "memory_report.json").read_text())
    assert rep["device"] == "cpu"
    assert [r["step"] for r in rep["steps"]] == [1, 2, 3, 4]
    first, last = rep["steps"][0], rep["steps"][-1]
    assert first["parameters"] == n_bytes and first["gradients"] == n_bytes
    assert first["gradients_method"] == "measured"
    assert first["optimizer_state"] == 2 * n_bytes + 16
    assert last["gradients"] == n_bytes and last["gradients_method"].startswith("estimated")
    # the step holds 2048 x 4096 float32 activations (32 MiB) twice (linear out, relu out) for backward
    assert rep["peak"]["activations_estimate"] > 16 * MiB
    for r in rep["steps"]:
        assert r["peak_bytes"] >= r["parameters"] + r["optimizer_state"]
        assert r["activations_estimate"] == max(0, r["peak_bytes"] - r["overhead"] - r["parameters"]
                                                - r["gradients"] - r["optimizer_state"])
    txt = (tmp_path / "memory_report.txt").read_text()
    assert "memory report: rank 0, device cpu" in txt
    assert "highest peak: " in txt and "optimizer state" in txt and "activations (est)" in txt


def test_memory_report_breakdown(tmp_path):
    import multiprocessing
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        pool.apply(_breakdown, (tmp_path,))  # an assertion failing there is raised here


def test_process_memory_readings():
    rss, peak = process_rss(), process_peak_rss()
    assert 10 * MiB < rss <= peak


def test_report_file_name_per_rank(tmp_path):
    t = tiny_trainer()
    mem = MemoryProfiler(tmp_path, rank=3, write_every=1)
    mem.on_train_start(t)
    train_step(t, batch=8)
    mem.on_step_end(t, {"step": 1})
    assert (tmp_path / "memory_report_rank3.json").exists() and (tmp_path / "memory_report_rank3.txt").exists()


def test_profiler_writes_a_trace_on_schedule(tmp_path):
    assert build_profiler(tmp_path, rank=1, enabled=True, dp_rank=1) is None
    assert build_profiler(tmp_path, rank=0, enabled=False) is None
    prof = build_profiler(tmp_path, rank=0, enabled=True, wait=1, warmup=1, active=2)
    assert isinstance(prof, TorchProfiler) and prof.out_dir == tmp_path / "profile"
    t = tiny_trainer()
    prof.on_train_start(t)
    for step in range(1, 6):
        train_step(t, batch=16)
        prof.on_step_end(t, {"step": step})
    prof.on_train_end(t)
    (trace,) = prof.traces()
    assert trace.name.startswith("rank0.")
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert "aten::addmm" in names
    assert sum(1 for e in events if str(e.get("name", "")).startswith("ProfilerStep#")) == 2
