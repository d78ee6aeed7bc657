"""Every parallel layout trains like one process: the same global batches give the same losses, metrics,
validation numbers and weights (fp32, gloo on CPU). One process group per layout, 5 steps, a tiny model.

The global batch is 4 micro-batches of 2 rows x 32 tokens: data parallel 2 runs micro_num 2 per rank
(rank r takes the rows after rank r-1's, see data/loader.py), tensor/pipeline parallel 2 run all 4.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

STEPS = 5
GLOBAL_MICRO = 4
LOSS_TOL = 1e-5        # the bound on the per-step loss
# max |w - w_ref| after 5 AdamW steps at lr 2e-3 (weights move up to ~1e-2): Adam divides by sqrt(v), which
# magnifies fp32 reduction-order (and, compiled, fusion) differences in small gradients, e.g. of rarely seen
# embedding rows (measured <= 2e-5). Adam is blind to a constant gradient factor: grad_norm, compared at 1e-5
# relative every step, is what catches a wrong scaling.
WEIGHT_TOL = 5e-5
BASE = ["data.seq_len=32", "data.micro_bsz=2", f"data.total_steps={STEPS}", f"data.valid_every={STEPS}",
        "data.dummy_num_samples=400", "data.fixed_random_dataset_seqlen=False", "data.num_worker=0",
        "data.empty_cache_and_diag_interval=1000",
        "model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4", "model.vocab_size=128",
        "model.multiple_of=32", "model.dtype=torch.float32", "model.use_flash_attn=False",
        "monitor.tensorboard=False", "monitor.log_every=100", "adam.lr=2e-3", "lr_scheduler.warmup_ratio=0.2",
        "ckpt.enable_save_ckpt=False"]
MODEL = {"INTERNLM": ["model_type=INTERNLM"],  # bias on q/k/v/o
         "INTERNLM2": ["model_type=INTERNLM2", "model.num_kv_attention_heads=2"]}  # grouped-query attention

# name: (processes, model type, overrides)
LAYOUTS = {
    "dp2": (2, "INTERNLM", ["parallel.zero1=1", "data.micro_num=2"]),
    "zero2": (2, "INTERNLM2", ["parallel.zero1=-1", "data.micro_num=2"]),
    "tp2": (2, "INTERNLM", ["parallel.tensor=2", "data.micro_num=4"]),
    "tp2_sp": (2, "INTERNLM2", ["parallel.tensor=2", "parallel.sequence_parallel=True", "data.micro_num=4",
                                "model.checkpoint=True", "model.compile=True"]),  # TP -> AC -> compile
    "pp2": (2, "INTERNLM2", ["parallel.pipeline=2", "data.micro_num=4"]),
    "pp2_interleaved": (2, "INTERNLM", ["parallel.pipeline=2", "model.num_chunks=2", "data.micro_num=4",
                                        "model.checkpoint=0.5"]),
    "dp2_tp2": (4, "INTERNLM2", ["parallel.tensor=2", "parallel.zero1=-1", "data.micro_num=2"]),
    # beyond the list: FSDP under the pipeline schedule, and pipeline x tensor x sequence parallel
    "dp2_pp2": (4, "INTERNLM2", ["parallel.pipeline=2", "parallel.zero1=-1", "data.micro_num=2"]),
    "pp2_tp2_sp_interleaved": (4, "INTERNLM", ["parallel.pipeline=2", "parallel.tensor=2", "model.num_chunks=2",
                                               "parallel.sequence_parallel=True", "data.micro_num=4"]),
}
# Checkpoints through the CheckpointManager: these layouts save at step CKPT_STEP; a run of another layout
# resumes from it (auto_resume) and trains the remaining steps.
CKPT_STEP = 3
SAVING = ("tp2", "pp2")
RESUMES = {  # name: (saved by, processes, model type, overrides of the resuming layout)
    "tp2_to_dp2": ("tp2", 2, "INTERNLM", ["parallel.zero1=-1", "data.micro_num=2"]),
    "pp2_to_tp2": ("pp2", 2, "INTERNLM2", ["parallel.tensor=2", "data.micro_num=4"]),
}
PROBE_ROW = 10_000  # validation probe: the global rows after this one (never trained on)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(model_type: str, overrides: list[str], world: int):
    from internlm_core.config import load_config
    return load_config("configs/tiny.py", BASE + MODEL[model_type] + overrides, world_size=world)


def _full_params(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone() for n, p in model.named_parameters()}


def _nan_agreement(trainer, rank: int) -> dict:
    """A non-finite gradient on one rank only (a replicated norm weight on tp rank 1 / the first pipeline
    stage) must make every rank skip the update."""
    from torch.distributed.tensor import DTensor
    model = trainer.model
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    names = [n for n, _ in model.named_parameters()]
    target = next(n for n in names if n.endswith("attention_norm.weight"))
    p = dict(model.named_parameters())[target]
    poison = (trainer.dims.tp > 1 and trainer.dims.tp_rank == 1) or (trainer.dims.pp > 1 and trainer.dims.pp_rank == 0)
    if poison:
        (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).fill_(float("nan"))
    before = _full_params(model)
    finite, _ = trainer.optimizer_step()
    after = _full_params(model)
    return {"finite": finite, "poisoned": poison,
            "unchanged": all(torch.equal(before[n], after[n]) for n in before)}


def _vocab_parallel_checks(trainer) -> dict:
    """Loss (with and without label smoothing, value and gradient) and argmax on vocabulary-sharded logits
    against the same on the gathered logits."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    from internlm_core.loss import FlashGPTLMLoss
    from internlm_core.metrics import vocab_parallel_argmax
    mb = next(trainer._micro_batches(trainer.train_loader.batch_at(PROBE_ROW), 1))
    labels = mb["labels"].clone()
    labels[0, :3] = -100  # ignored positions take part too
    with torch.no_grad():
        logits = trainer.model(mb["input_ids"], mb["position_ids"], mb["cu_seqlens"])
    assert isinstance(logits, DTensor)
    full = logits.full_tensor()
    out = {"argmax_equal": torch.equal(vocab_parallel_argmax(logits), full.argmax(dim=-1))}
    for eps in (0.0, 0.1):
        loss_fn = FlashGPTLMLoss(label_smoothing=eps, use_flash=False)
        local = logits.to_local().detach().requires_grad_(True)
        sharded = DTensor.from_local(local, logits.device_mesh, logits.placements, run_check=False)
        with loss_parallel():
            a, _ = loss_fn(sharded, labels)
            a.backward()
        ref_logits = full.detach().requires_grad_(True)
        b, _ = loss_fn(ref_logits, labels)
        b.backward()
        width = local.shape[-1]
        r = logits.device_mesh.get_local_rank()
        out[f"loss_diff_{eps}"] = abs(a.item() - b.item())
        out[f"grad_diff_{eps}"] = (local.grad - ref_logits.grad[..., r * width:(r + 1) * width]).abs().max().item()
    return out


def worker(rank: int, world: int, port: int, name: str, model_type: str, overrides: list[str], out: str) -> None:
    """One rank of one layout: train STEPS steps through build_trainer / Trainer.train, then record."""
    if world > 1:  # a spawned process of its own (world 1 runs in the test process: leave its environment alone)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        torch.set_num_threads(1)
    from internlm_core.callbacks import TrainerCallback
    from internlm_core.distributed import destroy_distributed, init_distributed
    from internlm_core.trainer.build import build_trainer, resolve_run_dir

    out_dir = Path(out)
    if name in SAVING:
        overrides = overrides + ["ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder={out_dir / 'ckpt'}",
                                 f"ckpt.checkpoint_every={CKPT_STEP}", "ckpt.save_at_end=False"]
    if name in RESUMES:
        overrides = overrides + [f"ckpt.save_ckpt_folder={out_dir.parent / RESUMES[name][0] / 'ckpt'}",
                                 "ckpt.auto_resume=True"]
    launch = init_distributed("torch" if world > 1 else "none", timeout_s=120)
    cfg = _config(model_type, overrides, launch.world_size)
    record: dict = {"losses": [], "acc": [], "ppl": [], "grad_norm": []}

    class Record(TrainerCallback):
        def on_step_end(self, trainer, metrics):
            for k in ("acc", "ppl", "grad_norm"):
                record[k].append(metrics[k])
            record["losses"].append(metrics["loss"])
            if name in SAVING and trainer.state.batch_count == CKPT_STEP:
                record["params_at_ckpt"] = _full_params(trainer.model)

        def on_validation_end(self, trainer, metrics):
            record["probe"] = {k: v for k, v in metrics.items() if k.startswith("valid/")}

    trainer = build_trainer(cfg, launch, resolve_run_dir(cfg, str(out_dir / "run"), launch), extra_callbacks=[Record()])
    # validation at the last step on rows never trained on, split over dp ranks like any validation batch
    trainer.valid_loaders = {"probe": [trainer.train_loader.batch_at(PROBE_ROW)]}
    if name in RESUMES:  # build_trainer resumed already
        record["params_after_load"] = _full_params(trainer.model)
        record["resumed_at"] = trainer.state.batch_count
    t0 = time.perf_counter()
    trainer.train()
    record["train_seconds"] = time.perf_counter() - t0
    record["params"] = _full_params(trainer.model)
    if name in ("tp2", "tp2_sp"):
        record["vocab_parallel"] = _vocab_parallel_checks(trainer)
    if name in ("tp2", "pp2"):
        record["nan"] = _nan_agreement(trainer, launch.rank)
    torch.save(record, out_dir / f"rank{launch.rank}.pt")
    destroy_distributed()


def run(name: str, world: int, model_type: str, overrides: list[str], root: Path) -> list[dict]:
    """Run a layout (world 1: in this process) and return every rank's record."""
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    if world == 1:
        worker(0, 1, 0, name, model_type, overrides, str(out))
    else:
        import torch.multiprocessing as mp
        mp.start_processes(worker, args=(world, free_port(), name, model_type, overrides, str(out)), nprocs=world,
                           start_method="spawn", join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    cache: dict[str, list[dict]] = {}

    def get(name: str) -> list[dict]:
        if name not in cache:
            if name.startswith("reference_"):
                cache[name] = run(name, 1, name[len("reference_"):], [f"data.micro_num={GLOBAL_MICRO}"], root)
            elif name in RESUMES:
                source, world, model_type, overrides = RESUMES[name]
                get(source)  # writes the checkpoint
                cache[name] = run(name, world, model_type, overrides, root)
            else:
                world, model_type, overrides = LAYOUTS[name]
                cache[name] = run(name, world, model_type, overrides, root)
        return cache[name]
    return get


def merged_params(records: list[dict]) -> dict[str, torch.Tensor]:
    """Union over ranks (pipeline stages hold different layers); ranks holding the same parameter agree exactly."""
    out: dict[str, torch.Tensor] = {}
    for r, rec in enumerate(records):
        for n, t in rec["params"].items():
            if n in out:
                assert torch.equal(out[n], t), f"rank {r} disagrees with another rank on {n}"
            else:
                out[n] = t
    return out


def max_weight_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(((a[n] - b[n]).abs().max().item(), n) for n in a)


def report(name: str, line: str) -> None:
    """PARALLEL_REPORT=file.jsonl: append the measured differences of each layout (for notes and reviews)."""
    if os.environ.get("PARALLEL_REPORT"):
        with open(os.environ["PARALLEL_REPORT"], "a") as f:
            f.write(json.dumps({"layout": name, **json.loads(line)}) + "\n")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(runs, name):
    world, model_type, _ = LAYOUTS[name]
    ref = runs(f"reference_{model_type}")[0]
    recs = runs(name)
    rank0 = recs[0]
    assert len(rank0["losses"]) == STEPS
    loss_diff = max(abs(a - b) for a, b in zip(rank0["losses"], ref["losses"]))
    # every rank computed the same reduced loss (logged once, by rank 0, but agreed everywhere)
    for r, rec in enumerate(recs):
        assert rec["losses"] == rank0["losses"], f"rank {r} reduced another loss"
    assert loss_diff <= LOSS_TOL, (rank0["losses"], ref["losses"])
    assert ref["losses"][-1] < ref["losses"][0] - 0.05  # it did learn something
    # ACC / PPL over the global batch (reduced over dp and pipeline, not double-counted over tp)
    for k in ("acc", "ppl", "grad_norm"):
        for a, b in zip(rank0[k], ref[k]):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-6), (k, rank0[k], ref[k])
    for k, v in ref["probe"].items():
        assert rank0["probe"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    assert ref["probe"]["valid/probe/loss"] > 0
    diff, where = max_weight_diff(merged_params(recs), ref["params"])
    report(name, json.dumps({"max_loss_diff": loss_diff, "max_weight_diff": diff, "at": where,
                             "train_seconds": rank0["train_seconds"]}))
    assert diff <= WEIGHT_TOL, (diff, where)


@pytest.mark.parametrize("name", ["tp2", "pp2"])
def test_nonfinite_gradient_on_one_rank_skips_everywhere(runs, name):
    recs = runs(name)
    assert [r["nan"]["poisoned"] for r in recs].count(True) == 1
    for rec in recs:
        assert rec["nan"]["finite"] is False
        assert rec["nan"]["unchanged"] is True


@pytest.mark.parametrize("name", ["tp2", "tp2_sp"])
def test_vocab_parallel_loss_and_argmax(runs, name):
    for rec in runs(name):
        v = rec["vocab_parallel"]
        assert v["argmax_equal"] is True
        for eps in (0.0, 0.1):
            assert v[f"loss_diff_{eps}"] <= 1e-6, v
            assert v[f"grad_diff_{eps}"] <= 1e-7, v


@pytest.mark.parametrize("name", list(RESUMES))
def test_checkpoint_resumes_under_another_layout(runs, name):
    """Saved by the CheckpointManager under one layout at step 3, resumed (auto_resume) under another:
    the same weights, and steps 4-5 as the uninterrupted single process."""
    source, _, model_type, _ = RESUMES[name]
    saved = merged_params([{"params": r["params_at_ckpt"]} for r in runs(source)])
    resumed = runs(name)
    ref = runs(f"reference_{model_type}")[0]
    for rec in resumed:
        assert rec["resumed_at"] == CKPT_STEP
        loaded = rec["params_after_load"]
        assert loaded.keys() == saved.keys()
        for n in saved:
            assert torch.equal(loaded[n], saved[n]), n
    losses = resumed[0]["losses"]
    assert len(losses) == STEPS - CKPT_STEP
    for a, b in zip(losses, ref["losses"][CKPT_STEP:]):
        assert abs(a - b) <= LOSS_TOL, (losses, ref["losses"])
    diff, where = max_weight_diff(merged_params(resumed), ref["params"])
    assert diff <= WEIGHT_TOL, (diff, where)
