"""model.mtp (multi-token prediction) trains like one process under context and pipeline parallel: CP 2 (ring, the
depths' targets shifted on the whole rows before the cut) and PP 2 (the depths on the last stage, their embeddings
sent from the first stage with the hidden states; activation checkpointing on, the depths' blocks included) give
the loss, mtp_loss and gradient norm of one process on the same batches (fp32, 3 steps, within 1e-5).

Rows of many short documents (tests/dist/test_context_parallel.py's data): a shift across a document, or across a
context chunk, changes mtp_loss at once. Both 2-process jobs run in one process group, one after the other.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.dist.test_context_parallel import BASE as CONTEXT_BASE, documents, free_port
from tests.helpers.warm import context

pytestmark = pytest.mark.slow

STEPS = 3
TOL = 1e-5
BASE = [o for o in CONTEXT_BASE if not o.startswith(("data.total_steps", "data.valid_every"))] + [
    f"data.total_steps={STEPS}", "data.valid_every=0", "model.mtp={'depth': 2, 'loss_weight': 0.3}"]
JOBS = {"reference": (1, []),
        "cp2": (2, ["parallel.context=2"]),
        "pp2_checkpoint": (2, ["parallel.pipeline=2", "model.checkpoint=True"])}


def run_job(name: str, launch, root: Path) -> None:
    from internlm_core.callbacks import TrainerCallback
    from internlm_core.config import load_config
    from internlm_core.trainer.build import build_trainer, resolve_run_dir

    cfg = load_config("configs/tiny.py", BASE + [f"data.train_folder={root / 'data'}",
                                                 f"ckpt.save_ckpt_folder={root / name / 'ckpt'}", *JOBS[name][1]],
                      world_size=launch.world_size)
    steps: dict = {}

    class Record(TrainerCallback):
        def on_step_end(self, trainer, metrics):
            steps[metrics["step"]] = {k: metrics[k] for k in ("loss", "mtp_loss", "grad_norm")}

    trainer = build_trainer(cfg, launch, resolve_run_dir(cfg, str(root / name / "run"), launch),
                            extra_callbacks=[Record()])
    record = {"steps": steps, "cp": trainer.dims.cp, "pp": trainer.dims.pp,
              "depths": trainer.mtp.module is not None}
    if name == "reference":  # validation runs the main model only: no depth ids, no depth logits left pending
        trainer.valid_loaders = {"probe": [trainer.train_loader.batch_at(5_000)]}
        record["valid"] = trainer.evaluate()
        record["pending_after_valid"] = len(trainer.mtp.module.pending)
    trainer.train()
    (root / name).mkdir(parents=True, exist_ok=True)
    torch.save(record, root / name / f"rank{launch.rank}.pt")


def worker(rank: int, world: int, port: int, names: list[str], root: str) -> None:
    if world > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        torch.set_num_threads(1)
    from internlm_core.distributed import destroy_distributed, init_distributed
    launch = init_distributed("torch" if world > 1 else "none", timeout_s=120)
    for name in names:
        run_job(name, launch, Path(root))
    destroy_distributed()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch.multiprocessing as mp
    root = tmp_path_factory.mktemp("mtp")
    documents(root / "data")
    worker(0, 1, 0, ["reference"], str(root))
    context()
    mp.start_processes(worker, args=(2, free_port(), ["cp2", "pp2_checkpoint"], str(root)), nprocs=2,
                       start_method="forkserver", join=True)
    return lambda name: [torch.load(root / name / f"rank{r}.pt", weights_only=False) for r in range(JOBS[name][0])]


@pytest.mark.parametrize("name", ["cp2", "pp2_checkpoint"])
def test_mtp_under_context_and_pipeline_parallel_matches_one_process(runs, name):
    recs, ref = runs(name), runs("reference")[0]
    assert (recs[0]["cp"], recs[0]["pp"]) == ((2, 1) if name == "cp2" else (1, 2))
    # the depths live on every context rank, and on the last pipeline stage only
    assert [r["depths"] for r in recs] == ([True, True] if name == "cp2" else [False, True])
    assert "valid/probe/loss" in ref["valid"] and ref["pending_after_valid"] == 0
    for rec in recs:  # every rank reports the same reduced values
        assert rec["steps"] == recs[0]["steps"]
    for step in range(1, STEPS + 1):
        got, want = recs[0]["steps"][step], ref["steps"][step]
        assert abs(got["loss"] - want["loss"]) <= TOL, (step, got, want)
        assert abs(got["mtp_loss"] - want["mtp_loss"]) <= TOL, (step, got, want)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), (step, got, want)
