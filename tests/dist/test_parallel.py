"""Every parallel layout trains like one process, in every precision, and a checkpoint of any layout resumes in
any other: the same global batches give the same losses, metrics, validation numbers and weights (gloo on CPU).

The global batch is 4 micro-batches of 2 rows x 32 tokens: data parallel 2 runs micro_num 2 per rank
(rank r takes the rows after rank r-1's, see data/loader.py), tensor/pipeline parallel 2 run all 4.
Every run passes each periodic event twice: the straggler check and validation every 2 steps, a checkpoint
every 2 steps (and at the end). All jobs of one world size run in one process group, one after the other
(`worker`): one launch checks many layouts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.warm import context

pytestmark = pytest.mark.slow

STEPS = 5
RESUME_STEPS = 10  # references run this long; resumed jobs continue from a step-5 checkpoint to it
GLOBAL_MICRO = 4
# fp32: the bound on the per-step loss. Layouts sum the same fp32 products in another order (tensor
# parallel splits matmuls, data parallel averages two half-batch gradients): measured differences <= 1e-6.
LOSS_TOL = 1e-5
# bf16 / fp16, relative to one process in the same precision. bf16 keeps 8 significant bits (one rounding up to
# 0.4%), fp16 11 bits (0.05%); the layouts round the same values in another order and at other places (FSDP
# all-gathers 16-bit weights where one process casts each weight per op under autocast; tensor parallel sums
# 16-bit partial products), and each step's update feeds the next. Measured over 5 steps: bf16 <= 2.0e-4,
# fp16 <= 1.2e-5 (PARALLEL_REPORT); 1% bounds them with room and still fails on a wrong scaling or a lost
# micro-batch (>= 5% here).
HALF_TOL = 1e-2
# max |w - w_ref| after 5 AdamW steps at lr 2e-3 (weights move up to ~1e-2): Adam divides by sqrt(v), which
# magnifies fp32 reduction-order (and, compiled, fusion) differences in small gradients, e.g. of rarely seen
# embedding rows (measured <= 2e-5). Adam is blind to a constant gradient factor: grad_norm, compared at 1e-5
# relative every step, is what catches a wrong scaling.
WEIGHT_TOL = 5e-5
BASE = ["data.seq_len=32", "data.micro_bsz=2", "data.valid_every=2",
        "data.dummy_num_samples=400", "data.fixed_random_dataset_seqlen=False", "data.num_worker=0",
        "data.empty_cache_and_diag_interval=2",
        "model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4", "model.vocab_size=128",
        "model.multiple_of=32", "model.use_flash_attn=False",
        "monitor.tensorboard=False", "monitor.log_every=100", "adam.lr=2e-3", "lr_scheduler.warmup_ratio=0.2",
        "lr_scheduler.total_steps=10", "ckpt.enable_save_ckpt=True", "ckpt.checkpoint_every=2",
        "ckpt.auto_resume=False"]
# the interleaved pipeline layouts (INTERNLM) need 4 layers: 2 stages x 2 chunks; 2 layers do for the rest
MODEL = {"INTERNLM": ["model_type=INTERNLM"],  # bias on q/k/v/o
         "INTERNLM2": ["model_type=INTERNLM2", "model.num_kv_attention_heads=2", "model.num_layers=2"]}  # GQA
DTYPES = {"fp32": "torch.float32", "bf16": "torch.bfloat16", "fp16": "torch.float16"}

# name: (processes, model type, precision, overrides)
LAYOUTS = {
    "dp2": (2, "INTERNLM", "fp32", ["parallel.zero1=1", "data.micro_num=2"]),  # replicated (DDP semantics)
    "zero2": (2, "INTERNLM2", "fp32", ["parallel.zero1=-1", "data.micro_num=2"]),  # FSDP over 2
    "hsdp": (4, "INTERNLM2", "fp32", ["parallel.zero1=2", "data.micro_num=1"]),  # shard 2 x replicate 2
    "tp2": (2, "INTERNLM", "fp32", ["parallel.tensor=2", "data.micro_num=4"]),
    "tp2_sp": (2, "INTERNLM2", "fp32", ["parallel.tensor=2", "parallel.sequence_parallel=True", "data.micro_num=4",
                                        "model.checkpoint=True", "model.compile=True"]),  # TP -> AC -> compile
    "pp2": (2, "INTERNLM2", "fp32", ["parallel.pipeline=2", "data.micro_num=4"]),
    "pp2_interleaved": (2, "INTERNLM", "fp32", ["parallel.pipeline=2", "model.num_chunks=2", "data.micro_num=4",
                                                "model.checkpoint=0.5"]),
    "dp2_tp2": (4, "INTERNLM2", "fp32", ["parallel.tensor=2", "parallel.zero1=-1", "data.micro_num=2"]),
    # FSDP under the pipeline schedule, and pipeline x tensor x sequence parallel
    "dp2_pp2": (4, "INTERNLM2", "fp32", ["parallel.pipeline=2", "parallel.zero1=-1", "data.micro_num=2"]),
    "pp2_tp2_sp_interleaved": (4, "INTERNLM", "fp32", ["parallel.pipeline=2", "parallel.tensor=2",
                                                       "model.num_chunks=2", "parallel.sequence_parallel=True",
                                                       "data.micro_num=4"]),
}
# the precision matrix: each against one process in the same precision (bf16: sharded data, tensor and pipeline
# parallel; fp16 with its loss scale: sharded data parallel). HSDP in bf16 and tensor parallel in fp16 ran here
# until make test needed the time: their casts and loss scaling are zero2's and tp2's, and the non-finite check
# below covers every tensor-parallel rank skipping a non-finite step together.
for _p, _names in (("bf16", ("zero2", "tp2", "pp2")), ("fp16", ("zero2",))):
    for _name in _names:
        _world, _mt, _, _ov = LAYOUTS[_name]
        LAYOUTS[f"{_name}_{_p}"] = (_world, _mt, _p, _ov)

# The resharding matrix: a step-5 checkpoint of each layout loads (ckpt.load_ckpt_info.path, content all) into
# another and trains steps 6-10. Every layout is a source once and a target once (pp2 and HSDP among them).
# name: (saved by, processes, overrides of the loading layout)
RESUMES = {
    "one_to_hsdp": ("reference_INTERNLM2_fp32", 4, ["parallel.zero1=2", "data.micro_num=1"]),
    "zero2_to_pp2": ("zero2", 2, ["parallel.pipeline=2", "data.micro_num=4"]),
    "hsdp_to_tp2": ("hsdp", 2, ["parallel.tensor=2", "parallel.sequence_parallel=True", "data.micro_num=4"]),
    "tp2_sp_to_one": ("tp2_sp", 1, ["data.micro_num=4"]),
    "pp2_to_zero2": ("pp2", 2, ["parallel.zero1=-1", "data.micro_num=2"]),
}
# the one-process runs the layouts compare with (fp32 of every model type: the resumes' reference too)
REFERENCES = [f"reference_{mt}_{p}" for mt in MODEL for p in DTYPES
              if p == "fp32" or any(w[1:3] == (mt, p) for w in LAYOUTS.values())]
SOURCES = {source for source, _, _ in RESUMES.values()}  # layouts whose step-5 checkpoint a resume loads
PROBE_ROW = 10_000  # validation probe: the global rows after this one (never trained on)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(name: str) -> tuple[int, str, str, list[str], int]:
    """(processes, model type, precision, overrides, steps) of a reference, layout or resume."""
    if name.startswith("reference_"):
        mt, p = name[len("reference_"):].rsplit("_", 1)
        # fp32 references run 10 steps (the resumes' reference) and save at step 5 (a source of the resumes)
        return 1, mt, p, [f"data.micro_num={GLOBAL_MICRO}", "ckpt.checkpoint_every=5"], \
            RESUME_STEPS if p == "fp32" else STEPS
    if name in RESUMES:
        source, world, overrides = RESUMES[name]
        _, mt, p, _, _ = job(source)
        return world, mt, p, overrides, RESUME_STEPS
    world, mt, p, overrides = LAYOUTS[name]
    return world, mt, p, overrides, STEPS


def _config(name: str, root: Path, world: int):
    from internlm_core.config import load_config
    _, mt, p, overrides, steps = job(name)
    overrides = BASE + MODEL[mt] + [f"model.dtype={DTYPES[p]}", f"data.total_steps={steps}",
                                    f"ckpt.save_ckpt_folder={root / name / 'ckpt'}"] + overrides
    if name not in SOURCES and not name.startswith("reference_"):  # no step-5 checkpoint needed: saves at 2 and 4
        overrides.append("ckpt.save_at_end=False")
    if name in RESUMES:
        source = root / RESUMES[name][0] / "ckpt" / str(STEPS)
        overrides.append(f"ckpt.load_ckpt_info={{'path': '{source}', 'content': ('all',)}}")
    return load_config("configs/tiny.py", overrides, world_size=world)


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


def _full_optim(trainer) -> dict[str, torch.Tensor]:
    """AdamW's exp_avg / exp_avg_sq of every parameter this rank holds, gathered to full tensors."""
    from torch.distributed.tensor import DTensor
    out = {}
    for name, p in trainer.model.named_parameters():
        for k, t in trainer.optimizer.state.get(p, {}).items():
            if k in ("exp_avg", "exp_avg_sq"):
                out[f"{name}.{k}"] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
    return out


def run_job(name: str, launch, root: Path) -> None:
    """One job on this process group: train through build_trainer / Trainer.train, then record."""
    from internlm_core.callbacks import TrainerCallback
    from internlm_core.trainer.build import build_trainer, resolve_run_dir

    out_dir = root / name
    cfg = _config(name, root, launch.world_size)
    record: dict = {"losses": [], "acc": [], "ppl": [], "grad_norm": [], "validations": 0, "straggler_checks": 0}

    class Record(TrainerCallback):
        def on_step_end(self, view, metrics):
            for k in ("acc", "ppl", "grad_norm"):
                record[k].append(metrics[k])
            record.setdefault("comm", []).append({k: v for k, v in metrics.items() if k.startswith("comm/")})
            record["losses"].append(metrics["loss"])
            if metrics["step"] == STEPS:  # what the 5-step layouts end with (the fp32 references go on to 10)
                record["params5"] = _full_params(view.model)
            # the run's straggler monitor (the trainer built below): it reported at this step, before this observer
            diag = next((cb for cb in trainer.callbacks.callbacks if type(cb).__name__ == "StragglerMonitor"), None)
            if diag is not None and diag.last_report is not None and diag.last_report.step == metrics["step"]:
                record["straggler_checks"] += 1

        def on_validation_end(self, view, metrics):
            record.setdefault("probe", {})[view.state.batch_count] = {
                k: v for k, v in metrics.items() if k.startswith("valid/")}
            record["validations"] += 1

    trainer = build_trainer(cfg, launch, resolve_run_dir(cfg, str(out_dir / "run"), launch), extra_callbacks=[Record()])
    record["pp_rank"] = trainer.dims.pp_rank
    # validation at steps 2 and 4 (twice, as every periodic event); not again at the end
    trainer.loop = dataclasses.replace(trainer.loop, validate_at_end=False)
    # validation on rows never trained on, split over dp ranks like any validation batch
    trainer.valid_loaders = {"probe": [trainer.train_loader.batch_at(PROBE_ROW)]}
    if name in RESUMES:  # build_trainer loaded the checkpoint already
        record["params_after_load"] = _full_params(trainer.model)
        record["optim_after_load"] = _full_optim(trainer)
        record["resumed_at"] = trainer.state.batch_count
    t0 = time.perf_counter()
    trainer.train()
    record["train_seconds"] = time.perf_counter() - t0
    record["params"] = _full_params(trainer.model)
    record["optim"] = _full_optim(trainer)
    record["saved"] = sorted(int(r.step) for r in trainer.checkpoint_manager.results if r.ok)
    if name in ("tp2", "tp2_sp"):
        record["vocab_parallel"] = _vocab_parallel_checks(trainer)
    if name in ("tp2", "pp2"):
        record["nan"] = _nan_agreement(trainer, launch.rank)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(record, out_dir / f"rank{launch.rank}.pt")


def worker(rank: int, world: int, port: int, names: list[str], root: str) -> None:
    """One rank: every job of this world size, in order, in one process group."""
    if world > 1:  # a spawned process of its own (world 1 runs in the test process: leave its environment alone)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        torch.set_num_threads(1)
    from internlm_core.distributed import destroy_distributed, init_distributed
    launch = init_distributed("torch" if world > 1 else "none", timeout_s=120)
    for name in names:
        run_job(name, launch, Path(root))
    destroy_distributed()


def run_all(root: Path) -> None:
    """Every job, in phases that respect the checkpoints the resumes load: one launch per world size."""
    import torch.multiprocessing as mp
    names = REFERENCES + list(LAYOUTS) + list(RESUMES)
    after = {n for n in RESUMES if job(RESUMES[n][0])[0] != 1}  # resumes of multi-process sources
    phases = [[n for n in names if job(n)[0] == 1 and n not in after],
              [n for n in names if job(n)[0] == 4 and n not in RESUMES or n == "one_to_hsdp"],
              [n for n in names if job(n)[0] == 2],
              [n for n in names if job(n)[0] == 1 and n in after]]
    for names_ in phases:
        if not names_:
            continue
        world = job(names_[0])[0]
        if world == 1:
            worker(0, 1, 0, names_, str(root))
        else:  # forks of a warm interpreter (tests/helpers/warm.py): torch and internlm_core already imported
            context()
            mp.start_processes(worker, args=(world, free_port(), names_, str(root)), nprocs=world,
                               start_method="forkserver", join=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    run_all(root)

    def get(name: str) -> list[dict]:
        return [torch.load(root / name / f"rank{r}.pt", weights_only=False) for r in range(job(name)[0])]
    if os.environ.get("PARALLEL_LOSSES"):
        # PARALLEL_LOSSES=file.json: every job's per-step losses and gradient norms, exactly as logged (a refactor
        # compares them bitwise with the same file written before it)
        jobs = [*REFERENCES, *LAYOUTS, *RESUMES]
        Path(os.environ["PARALLEL_LOSSES"]).write_text(json.dumps(
            {n: {k: get(n)[0][k] for k in ("losses", "grad_norm")} for n in jobs}, indent=1))
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


def merged_optim(records: list[dict], key: str = "optim") -> dict[str, torch.Tensor]:
    return merged_params([{"params": r[key]} for r in records])


@pytest.mark.parametrize("name", [n for n in LAYOUTS if LAYOUTS[n][2] == "fp32"])
def test_layout_matches_single_process(runs, name):
    world, model_type, _, _ = LAYOUTS[name]
    ref = runs(f"reference_{model_type}_fp32")[0]
    recs = runs(name)
    rank0 = recs[0]
    assert len(rank0["losses"]) == STEPS
    loss_diff = max(abs(a - b) for a, b in zip(rank0["losses"], ref["losses"]))
    # every rank computed the same reduced loss (logged once, by rank 0, but agreed everywhere)
    for r, rec in enumerate(recs):
        assert rec["losses"] == rank0["losses"], f"rank {r} reduced another loss"
        # each periodic event twice: validation, the straggler check and a save at steps 2 and 4 (and a save at the
        # end, 5, where a resume loads it)
        saved = [2, 4, 5] if name in SOURCES else [2, 4]
        assert sorted(rec["probe"]) == [2, 4] and rec["straggler_checks"] == 2 and rec["saved"] == saved, rec
    assert loss_diff <= LOSS_TOL, (rank0["losses"], ref["losses"])
    assert ref["losses"][STEPS - 1] < ref["losses"][0] - 0.05  # it did learn something
    # ACC / PPL over the global batch (reduced over dp and pipeline, not double-counted over tp)
    for k in ("acc", "ppl", "grad_norm"):
        for a, b in zip(rank0[k], ref[k][:STEPS]):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-6), (k, rank0[k], ref[k])
    # validation on held-out rows at steps 2 and 4, as one process validates them
    for step in (2, 4):
        for k, v in ref["probe"][step].items():
            assert rank0["probe"][step][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (step, k)
    assert ref["probe"][4]["valid/probe/loss"] > 0
    diff, where = max_weight_diff(merged_params([{"params": r["params5"]} for r in recs]), ref["params5"])
    report(name, json.dumps({"max_loss_diff": loss_diff, "max_weight_diff": diff, "at": where,
                             "train_seconds": rank0["train_seconds"]}))
    assert diff <= WEIGHT_TOL, (diff, where)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if LAYOUTS[n][2] != "fp32"])
def test_half_precision_layout_matches_single_process(runs, name):
    _, model_type, precision, _ = LAYOUTS[name]
    ref = runs(f"reference_{model_type}_{precision}")[0]["losses"]
    losses = runs(name)[0]["losses"]
    assert len(losses) == len(ref) == STEPS
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    report(name, json.dumps({"max_rel_loss_diff": rel}))
    assert rel <= HALF_TOL, (losses, ref)
    assert ref[-1] < ref[0] - 0.05


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




@pytest.mark.parametrize("name", ["zero2", "hsdp", "dp2_tp2", "dp2_pp2", "zero2_bf16"])
def test_fsdp_bytes_per_step_are_the_estimated(runs, name, tmp_path):
    """The comm/* metrics (FSDP's all-gathers and reduce-scatters, counted as they run) equal the estimator's
    prediction in a steady step (2 and 4: after a training step): the counts exactly, the bytes within 1% (tensor
    parallel replicates the norms, which the estimate divides by tensor like every other parameter; FSDP pads
    dim 0 to a multiple of its group). A step after a validation finds weights the validation left gathered (the
    root, and under pipeline parallel the stage's blocks): fewer gathers, never more, and the same reductions."""
    from internlm_core.estimate import estimate
    world = job(name)[0]
    e = estimate(_config(name, tmp_path, world), world, device="cpu")
    c = e.communication
    assert c.gathers > 0 and c.reduces > 0
    stage = e.memory.stage  # the busiest pipeline stage ("all" without pipeline parallel)
    checked = 0
    for rec in runs(name):
        if stage != "all" and rec["pp_rank"] != (0 if stage == "first" else 1):
            continue
        assert len(rec["comm"]) == STEPS
        for i, step in enumerate(rec["comm"], start=1):
            assert step["comm/reduces"] == c.reduces, (i, step, c)
            assert step["comm/reduced_bytes"] == pytest.approx(c.reduced_bytes, rel=0.01), (i, step, c)
            if i in (2, 4):  # steady steps
                assert step["comm/gathers"] == c.gathers, (i, step, c)
                assert step["comm/gathered_bytes"] == pytest.approx(c.gathered_bytes, rel=0.01), (i, step, c)
            elif i in (3, 5):  # after the validations of steps 2 and 4
                assert 0 < step["comm/gathers"] < c.gathers, (i, step, c)
        checked += 1
    assert checked >= 1


@pytest.mark.parametrize("name", list(RESUMES))
def test_checkpoint_of_one_layout_resumes_in_another(runs, name):
    """A step-5 checkpoint loads into another layout (load_ckpt_info, content all) with the saver's weights and
    AdamW state, and steps 6-10 give the uninterrupted single process's losses."""
    source = RESUMES[name][0]
    _, model_type, _, _, _ = job(name)
    saver = runs(source)
    saved = merged_params([{"params": r["params5"]} for r in saver])
    saved_optim = merged_optim(saver) if source in LAYOUTS else None
    resumed = runs(name)
    ref = runs(f"reference_{model_type}_fp32")[0]
    assert all(rec["resumed_at"] == STEPS for rec in resumed)
    loaded = merged_params([{"params": r["params_after_load"]} for r in resumed])  # pipeline: stages per rank
    assert loaded.keys() == saved.keys()
    for n in saved:
        assert torch.equal(loaded[n], saved[n]), n
    if saved_optim is not None:  # a 5-step layout: its AdamW state at the end is the saved one
        loaded_optim = merged_optim(resumed, "optim_after_load")
        assert loaded_optim.keys() == saved_optim.keys() and len(saved_optim) > 0
        for n in saved_optim:
            assert torch.equal(loaded_optim[n], saved_optim[n]), n
    losses = resumed[0]["losses"]
    assert len(losses) == RESUME_STEPS - STEPS
    for a, b in zip(losses, ref["losses"][STEPS:]):
        assert abs(a - b) <= LOSS_TOL, (losses, ref["losses"])
    diff, where = max_weight_diff(merged_params(resumed), ref["params"])
    assert diff <= 2 * WEIGHT_TOL, (diff, where)  # 10 AdamW steps
