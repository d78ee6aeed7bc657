"""Context parallel trains like one process (issue 26): CP 2 (ring and all_to_all) and CP 4 (2d) give the losses,
gradient norms, ACC (per dataset type too) / PPL and validation numbers of CP 1 on the same batches (fp32, 10
steps, within 1e-5), on rows of many short documents and rows of one long document, with GQA, with FSDP (over the
context ranks, and over data x context parallel), with tensor parallel and with pipeline parallel; a CP 2 checkpoint resumes at CP 1 and
CP 4 as the uninterrupted run goes on (gloo on CPU).

The global batch is 4 micro-batches of one 64-token row: context ranks read the same rows (data parallel 1), data
parallel 2 x context 2 reads 2 micro-batches per rank. All jobs of one world size run in one process group, one
after the other (`worker`), as tests/dist/test_parallel.py does.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.warm import context

pytestmark = pytest.mark.slow

STEPS = 10
RESUME_AT = 5
LOSS_TOL = 1e-5  # the bound (fp32); ring / all-to-all attention sums the same products in another order
# GQA throughout (INTERNLM2, 2 key/value heads for 4 query heads)
BASE = ["model_type=INTERNLM2", "model.num_kv_attention_heads=2",
        "data.seq_len=64", "data.micro_bsz=1", "data.micro_num=4", "data.valid_every=5", "data.num_worker=0",
        f"data.total_steps={STEPS}", "data.empty_cache_and_diag_interval=100",
        "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.vocab_size=128",
        "model.multiple_of=32", "model.use_flash_attn=False", "model.dtype=torch.float32",
        "monitor.tensorboard=False", "monitor.log_every=100", "adam.lr=2e-3", "lr_scheduler.warmup_ratio=0.2",
        "ckpt.enable_save_ckpt=False", "ckpt.auto_resume=False"]
A2A, TWO_D = "{'size': 2, 'mode': 'all_to_all'}", "{'size': 4, 'mode': '2d', 'inner': 2}"

# name: (processes, overrides); the reference is CP 1 on one process
JOBS = {
    "reference": (1, []),
    "cp2_ring": (2, ["parallel.context=2", "ckpt.enable_save_ckpt=True", f"ckpt.checkpoint_every={RESUME_AT}",
                     "ckpt.save_at_end=False"]),  # FSDP over the 2 context ranks; the resumes' source
    "cp2_a2a": (2, [f"parallel.context={A2A}"]),
    "cp4_2d": (4, [f"parallel.context={TWO_D}"]),
    "dp2_cp2_fsdp": (4, [f"parallel.context={A2A}", "parallel.zero1=-1", "data.micro_num=2"]),
    "tp2_cp2": (4, ["parallel.context=2", "parallel.tensor=2"]),
    "pp2_cp2": (4, [f"parallel.context={A2A}", "parallel.pipeline=2"]),  # the stages pass each rank's chunk on
    "cp2_to_cp4": (4, ["parallel.context=4"]),
    "cp2_to_cp1": (1, []),
}
RESUMES = ("cp2_to_cp4", "cp2_to_cp1")
PROBE_ROW = 5_000  # validation probe: rows after this one (never trained on)


def documents(folder: Path) -> None:
    """Three dataset types: "web" and "code" of documents of 2-16 tokens (a 64-token row packs many of them) and
    "book" of 150-250 tokens (rows of one long document)."""
    from internlm_core.data.formats import OursWriter
    rng = np.random.default_rng(0)
    for name, low, lengths in (("web", 1, (2, 17, 1500)), ("code", 64, (2, 17, 800)), ("book", 30, (150, 251, 60))):
        (folder / name).mkdir(parents=True)
        w = OursWriter(str(folder / name / "a.bin"), str(folder / name / "a.bin.meta"), 128)
        for n in rng.integers(*lengths):
            w.write(rng.integers(low, low + 60, size=int(n)))
        w.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(name: str, root: Path, world: int):
    from internlm_core.config import load_config
    overrides = BASE + [f"data.train_folder={root / 'data'}", f"ckpt.save_ckpt_folder={root / name / 'ckpt'}",
                        *JOBS[name][1]]
    if name in RESUMES:
        source = root / "cp2_ring" / "ckpt" / str(RESUME_AT)
        overrides.append(f"ckpt.load_ckpt_info={{'path': '{source}', 'content': ('all',)}}")
    return load_config("configs/tiny.py", overrides, world_size=world)


def run_job(name: str, launch, root: Path) -> None:
    """One job on this process group: train through build_trainer / Trainer.train, then record."""
    from internlm_core.callbacks import TrainerCallback
    from internlm_core.trainer.build import build_trainer, resolve_run_dir

    cfg = _config(name, root, launch.world_size)
    record: dict = {"steps": {}, "probe": {}}

    class Record(TrainerCallback):
        def on_step_end(self, trainer, metrics):
            record["steps"][metrics["step"]] = {k: v for k, v in metrics.items() if k in ("loss", "grad_norm")
                                                or k.split("/")[0] in ("acc", "ppl")}

        def on_validation_end(self, trainer, metrics):
            record["probe"][trainer.state.batch_count] = {k: v for k, v in metrics.items() if k.startswith("valid/")}

    trainer = build_trainer(cfg, launch, resolve_run_dir(cfg, str(root / name / "run"), launch),
                            extra_callbacks=[Record()])
    trainer.valid_loaders = {"probe": [trainer.train_loader.batch_at(PROBE_ROW)]}
    record["cp"], record["resumed_at"] = trainer.dims.cp, trainer.state.batch_count
    # documents per row of the trained rows (the reference reads them all: data parallel 1, micro_bsz 1)
    record["documents"] = [len(trainer.train_loader.batch_at(i)["cu_seqlens"][0]) - 1 for i in range(STEPS * 4)]
    trainer.train()
    (root / name).mkdir(parents=True, exist_ok=True)
    torch.save(record, root / name / f"rank{launch.rank}.pt")


def worker(rank: int, world: int, port: int, names: list[str], root: str) -> None:
    """One rank: every job of this world size, in order, in one process group."""
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
    root = tmp_path_factory.mktemp("context")
    documents(root / "data")
    # references and the CP 2 source first; the resumes of its step-5 checkpoint after it
    phases = [[n for n in JOBS if JOBS[n][0] == 1 and n not in RESUMES],
              [n for n in JOBS if JOBS[n][0] == 2],
              [n for n in JOBS if JOBS[n][0] == 4],
              [n for n in RESUMES if JOBS[n][0] == 1]]
    for names in phases:
        world = JOBS[names[0]][0]
        if world == 1:
            worker(0, 1, 0, names, str(root))
        else:
            context()
            mp.start_processes(worker, args=(world, free_port(), names, str(root)), nprocs=world,
                               start_method="forkserver", join=True)
    return lambda name: [torch.load(root / name / f"rank{r}.pt", weights_only=False) for r in range(JOBS[name][0])]


def _assert_same_run(got: dict, ref: dict, steps: range) -> float:
    """Losses within LOSS_TOL, gradient norms and every acc / ppl metric (per type too) within 1e-5 relative;
    the worst loss difference."""
    worst = 0.0
    for step in steps:
        a, b = got["steps"][step], ref["steps"][step]
        assert a.keys() == b.keys(), (step, sorted(a), sorted(b))
        worst = max(worst, abs(a["loss"] - b["loss"]))
        assert abs(a["loss"] - b["loss"]) <= LOSS_TOL, (step, a["loss"], b["loss"])
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (step, k, a[k], b[k])
    return worst


def test_the_rows_hold_many_short_documents_and_one_long_one(runs):
    docs = runs("reference")[0]["documents"]
    assert min(docs) == 1 and max(docs) >= 6, docs


@pytest.mark.parametrize("name", [n for n in JOBS if n != "reference" and n not in RESUMES])
def test_context_parallel_matches_one_process(runs, name):
    recs, ref = runs(name), runs("reference")[0]
    assert recs[0]["cp"] == int(name.split("cp")[-1][0])
    for r, rec in enumerate(recs):  # every rank reduced the same loss and metrics
        assert rec["steps"] == recs[0]["steps"], f"rank {r} disagrees"
    _assert_same_run(recs[0], ref, range(1, STEPS + 1))
    assert {"acc/web", "acc/code", "acc/book"} <= set(ref["steps"][1])  # every type's accuracy, compared above
    assert ref["steps"][STEPS]["loss"] < ref["steps"][1]["loss"] - 0.05  # it did learn something
    for step in (5, 10):  # validation on held-out rows
        assert ref["probe"][step], step
        for k, v in ref["probe"][step].items():
            assert recs[0]["probe"][step][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (step, k)


@pytest.mark.parametrize("name", RESUMES)
def test_context_parallel_checkpoint_resumes_at_another_size(runs, name):
    """The CP 2 checkpoint of step 5 loads at CP 1 and CP 4 and steps 6-10 are those of the uninterrupted run."""
    rec, ref = runs(name)[0], runs("reference")[0]
    assert rec["resumed_at"] == RESUME_AT and sorted(rec["steps"]) == list(range(RESUME_AT + 1, STEPS + 1))
    _assert_same_run(rec, ref, range(RESUME_AT + 1, STEPS + 1))
