"""Every pipeline schedule trains like 1F1B (issue 38 item 1): the zero-bubble ones (interleaved_zb, zbv, dualpipev:
backward split into input and weight passes, the V ones two stages per rank in V order) give 1F1B's losses,
gradient norms, per-layer MoE metrics, weights and gradients, with FSDP (pipeline 2 x data 2), with context
parallel (pipeline 2 x context 2), with an MoE family (its auxiliary losses backpropagated once per micro-batch)
and with activation checkpointing. One launch of 4 gloo ranks runs every job in one process group, one after the
other; each job trains STEPS fp32 steps through build_trainer / Trainer.train, then one more forward and backward
whose gradients are compared.

`make test` runs QUICK (an MoE family with FSDP and activation checkpointing under zbv against 1F1B, 2 steps: ~5 s
a job on 4 ranks of 2 cores); PIPELINE_SCHEDULES_ALL=1 runs every job of JOBS for 10 steps (the issue's check, run
by hand: 9 schedule x composition jobs against their 1F1B references).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from tests.dist.test_parallel import _full_params, free_port
from tests.helpers.warm import context

pytestmark = pytest.mark.slow

ALL = bool(os.environ.get("PIPELINE_SCHEDULES_ALL"))
STEPS = 10 if ALL else 2  # the issue asks 10; 2 in make test (a wrong factor shows in step 1)
WORLD = 4
TOL = 1e-5  # fp32: the schedules sum the same products in another order (measured below 1e-6)
BASE = ["data.seq_len=32", "data.micro_bsz=1", "data.micro_num=4", "data.valid_every=0", "data.num_worker=0",
        "data.dummy_num_samples=200", "data.fixed_random_dataset_seqlen=False", "model.num_layers=4",
        "model.hidden_size=32", "model.num_attention_heads=4", "model.vocab_size=64", "model.multiple_of=16",
        "model.use_flash_attn=False", "model.dtype=torch.float32", "monitor.tensorboard=False",
        "monitor.log_every=100", "adam.lr=2e-3", f"data.total_steps={STEPS}", f"lr_scheduler.total_steps={STEPS}",
        "ckpt.enable_save_ckpt=False", "parallel.pipeline=2"]
FAMILY = {"dense": ["model_type=INTERNLM2", "model.num_kv_attention_heads=2", "parallel.zero1=-1"],  # FSDP over 2
          "cp": ["model_type=INTERNLM2", "parallel.context=2"],  # pipeline 2 x context 2
          "moe": ["model_type=INTERNLM_MoE", "model.num_experts=4", "moe.top_k=2", "model.moe_type=Dropless",
                  "moe.z_loss_coeff=0.001", "loss.moe_loss_coeff=0.01", "parallel.zero1=-1"]}
V = ["model.num_chunks=2"]
# name: (family, schedule, overrides); each family's 1f1b job is its reference
JOBS = {"dense_1f1b": ("dense", "1f1b", []),
        "dense_interleaved_zb": ("dense", "interleaved_zb", []),
        "dense_zbv_checkpoint": ("dense", "zbv", [*V, "model.checkpoint=True"]),
        "dense_dualpipev": ("dense", "dualpipev", V),
        "cp_1f1b": ("cp", "1f1b", []),
        "cp_zbv": ("cp", "zbv", V),
        "moe_1f1b": ("moe", "1f1b", []),
        "moe_zbv": ("moe", "zbv", V),
        "moe_zbv_checkpoint": ("moe", "zbv", [*V, "model.checkpoint=True"]),
        "moe_interleaved_zb": ("moe", "interleaved_zb", V),
        "moe_dualpipev": ("moe", "dualpipev", V)}
QUICK = ("moe_1f1b", "moe_zbv_checkpoint")  # FSDP, an MoE family and checkpointing under the V split backward
RUN = list(JOBS) if ALL else list(QUICK)


def _config(name: str):
    from internlm_core.config import load_config
    family, schedule, overrides = JOBS[name]
    return load_config("configs/tiny.py", [*BASE, *FAMILY[family], f"parallel.pipeline_schedule={schedule}",
                                           *overrides], world_size=WORLD)


def _full_grads(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in model.named_parameters() if p.grad is not None}


def run_job(name: str, launch, root: Path) -> None:
    from internlm_core.callbacks import TrainerCallback
    from internlm_core.trainer.build import build_trainer, resolve_run_dir

    cfg = _config(name)
    record: dict = {"steps": []}

    class Record(TrainerCallback):
        def on_step_end(self, view, metrics):
            record["steps"].append({k: v for k, v in metrics.items()
                                    if k in ("loss", "grad_norm") or k.startswith("moe/")})

    trainer = build_trainer(cfg, launch, resolve_run_dir(cfg, str(root / name / "run"), launch),
                            extra_callbacks=[Record()])
    trainer.loop = dataclasses.replace(trainer.loop, validate_at_end=False)
    trainer.train()
    record["params"] = _full_params(trainer.model)
    record["schedule"] = trainer.pipeline.schedule_name
    record["stages"] = trainer.pipeline.stage_ids
    trainer.forward_backward(trainer.train_loader.batch_at(1000))  # rows never trained on
    record["grads"] = _full_grads(trainer.model)
    trainer.optimizer.zero_grad(set_to_none=True)
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    torch.save(record, out / f"rank{launch.rank}.pt")


def worker(rank: int, port: int, root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from internlm_core.distributed import destroy_distributed, init_distributed
    launch = init_distributed("torch", timeout_s=120)
    for name in RUN:
        run_job(name, launch, Path(root))
    destroy_distributed()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch.multiprocessing as mp
    root = tmp_path_factory.mktemp("schedules")
    context()  # forks of a warm interpreter (tests/helpers/warm.py)
    mp.start_processes(worker, args=(free_port(), str(root)), nprocs=WORLD, start_method="forkserver", join=True)
    return lambda name: [torch.load(root / name / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _merged(records: list[dict], key: str) -> dict[str, torch.Tensor]:
    """Union over ranks (stages hold different layers); ranks holding the same tensor agree exactly."""
    out: dict[str, torch.Tensor] = {}
    for rec in records:
        for n, t in rec[key].items():
            assert n not in out or torch.equal(out[n], t), n
            out[n] = t
    return out


def _steps(records: list[dict]) -> list[dict]:
    """Each step's metrics, the same on every rank: the loss, the norm and the MoE metrics of every layer and over
    all layers (each stage holds other layers; moe_step_metrics merges them over the pipeline stages)."""
    out = []
    for step in range(len(records[0]["steps"])):
        merged: dict = {}
        for rec in records:
            for k, v in rec["steps"][step].items():
                assert k not in merged or merged[k] == pytest.approx(v, rel=1e-6, abs=1e-7), (step, k)
                merged[k] = v
        assert all(sorted(rec["steps"][step]) == sorted(merged) for rec in records), step
        out.append(merged)
    return out


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str, rel: float) -> None:
    assert sorted(a) == sorted(b), what
    for n in a:
        scale = max(float(b[n].detach().abs().max()), 1e-3)
        assert float((a[n] - b[n]).abs().max()) <= rel * scale, (what, n, float((a[n] - b[n]).abs().max()), scale)


@pytest.mark.parametrize("name", [n for n in RUN if JOBS[n][1] != "1f1b"])
def test_schedule_trains_like_1f1b(runs, name):
    family, schedule, _ = JOBS[name]
    got, ref = runs(name), runs(f"{family}_1f1b")
    assert got[0]["schedule"] == schedule
    if schedule in ("zbv", "dualpipev"):  # V order: pipeline rank r (global ranks 2r, 2r + 1) runs r and 3 - r
        assert [r["stages"] for r in got] == [[0, 3], [0, 3], [1, 2], [1, 2]]
    a, b = _steps(got), _steps(ref)
    assert len(a) == len(b) == STEPS
    if family == "moe":  # every rank reported all four layers and the aggregates over them
        assert {k.split("/")[1] for k in a[0] if k.startswith("moe/layer")} == {f"layer{i}" for i in range(4)}
        assert "moe/max_load" in a[0] and "moe/aux_loss" in a[0]
    for step in range(STEPS):
        assert sorted(a[step]) == sorted(b[step]), step
        for k in a[step]:  # loss, grad_norm and (MoE) every layer's loads, aux and z losses
            assert a[step][k] == pytest.approx(b[step][k], rel=TOL, abs=1e-7), (name, step, k)
    _close(_merged(got, "grads"), _merged(ref, "grads"), f"{name} gradients", 1e-4)
    _close(_merged(got, "params"), _merged(ref, "params"), f"{name} weights", 1e-4)
