#!/usr/bin/env python
"""How long a checkpoint blocks the training loop: asynchronous save vs synchronous save of the same state.

The state is a real model of the InternLM family (default about 80M parameters: hidden 640, 8 layers, vocabulary
32000), its AdamW state after one step, and everything else a run registers (schedules, train state, data loader
state, RNG), saved by `CheckpointManager` into a local folder exactly as `train.py` does:

    sync   ckpt.async_upload=False: the loop waits until shards, index, meta.json and the COMPLETE marker are durable
    async  ckpt.async_upload=True: the loop waits while the state is copied into CPU memory (staging); writing,
           fsync and the marker happen in the background (first save: staging buffers allocated; later saves reuse
           them)

and, as the peer, what a bare training loop does: `torch.save` of the model and optimizer state dicts into one file,
then fsync. Each mode runs `--repeat` times (median shown); the next save starts after the previous one completed, as
with any realistic `checkpoint_every`. Target: async blocked time at most 20% of the synchronous save's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from internlm_core.checkpoint import CheckpointManager, RNGState  # noqa: E402
from internlm_core.config import load_config  # noqa: E402
from internlm_core.config.schema import CkptConfig  # noqa: E402
from internlm_core.model import build_model, count_parameters  # noqa: E402
from internlm_core.optim import build_optimizer  # noqa: E402
from internlm_core.trainer.build import build_schedulers  # noqa: E402
from internlm_core.trainer.state import TrainState  # noqa: E402


def build_state(hidden: int, layers: int, vocab: int):
    cfg = load_config(ROOT / "configs/tiny.py", [f"model.hidden_size={hidden}", f"model.num_layers={layers}",
                                                  f"model.vocab_size={vocab}", "model.num_attention_heads=10"])
    torch.manual_seed(0)
    model = build_model(cfg, "cpu")
    opt = build_optimizer(model, cfg.adam, "fused")
    for p in model.parameters():  # one optimizer step: Adam's moments exist, as in any real checkpoint
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    lr, beta2 = build_schedulers(cfg, opt)
    state = TrainState()
    state.batch_count = state.step_count = 1
    return cfg, model, opt, lr, beta2, state


def manager(folder: Path, async_save: bool, model, opt, lr, beta2, state) -> CheckpointManager:
    m = CheckpointManager(CkptConfig(enable_save_ckpt=True, save_ckpt_folder=str(folder), async_upload=async_save,
                                     auto_resume=False), config_text="bench")
    m.register_model(model, opt)
    m.register("lr_scheduler", lr, content="scheduler")
    m.register("beta2_scheduler", beta2, content="scheduler")
    m.register("train_state", state, content="sampler")
    m.register("rng", RNGState(), content="sampler", scope="rank", strict=False)
    return m


def run_manager(folder: Path, async_save: bool, repeat: int, parts) -> list[tuple[float, float]]:
    m = manager(folder, async_save, *parts)
    out = []
    for i in range(repeat):
        t0 = time.perf_counter()
        m.save(100 + i, "bench")
        blocked = time.perf_counter() - t0
        res = m.wait()
        if not res.ok:
            raise SystemExit(f"save failed: {res.error}")
        out.append((blocked, time.perf_counter() - t0))
        shutil.rmtree(folder / str(100 + i))
    m.close()
    return out


def run_torch_save(folder: Path, repeat: int, model, opt) -> list[tuple[float, float]]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(repeat):
        t0 = time.perf_counter()
        path = folder / f"ckpt{i}.pt"
        with open(path, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        dt = time.perf_counter() - t0
        out.append((dt, dt))
        path.unlink()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=640)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--folder", default=None, help="where to write (default: a temporary folder)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    parts = build_state(args.hidden, args.layers, args.vocab)
    model, opt = parts[1], parts[2]
    n = count_parameters(model)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    root = Path(args.folder) if args.folder else Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    try:
        rows = {}
        rows["torch.save + fsync (bare-loop peer)"] = run_torch_save(root / "torch_save", args.repeat, model, opt)
        rows["ours sync (async_upload=False)"] = run_manager(root / "sync", False, args.repeat, parts[1:])
        asyn = run_manager(root / "async", True, args.repeat + 1, parts[1:])
        rows["ours async, first save (buffers allocated)"] = asyn[:1]
        rows["ours async, later saves (buffers reused)"] = asyn[1:]
    finally:
        if not args.folder:
            shutil.rmtree(root, ignore_errors=True)

    sync_blocked = statistics.median(b for b, _ in rows["ours sync (async_upload=False)"])
    print(f"\ncheckpoint of {n / 1e6:.1f}M parameters + AdamW state ({state_bytes / 1e9:.2f} GB), "
          f"median of {args.repeat}, {torch.get_num_threads()} threads, {root}")
    print(f"{'mode':46s} {'blocked s':>10s} {'complete s':>11s} {'blocked / sync':>15s}")
    for name, vals in rows.items():
        b = statistics.median(v[0] for v in vals)
        c = statistics.median(v[1] for v in vals)
        print(f"{name:46s} {b:10.3f} {c:11.3f} {b / sync_blocked:14.1%}")
    steady = statistics.median(b for b, _ in rows["ours async, later saves (buffers reused)"])
    verdict = "meets" if steady <= 0.2 * sync_blocked else "misses"
    print(f"\nasync blocked time is {steady / sync_blocked:.1%} of the synchronous save ({verdict} the <= 20% target)")


if __name__ == "__main__":
    main()
