"""The loss contract's two reductions on real ranks (gloo): with token counts uneven between micro-batches, ranks and
context chunks (one micro-batch has none at all), data parallel 2 (FSDP), context parallel 2 and pipeline parallel
2 give the gradient and the loss of one process's global token mean (loss.reduction token_mean), and of its mean
of micro-batch means (micro_batch_mean: InternLM's numbers), each written out by hand with plain autograd.

The global batch is 4 micro-batches of 2 rows x 32 tokens (data parallel 2: rank r takes micro-batches 2r, 2r + 1,
as the loader gives them); each job runs one forward/backward per reduction, no optimizer step. One launch of 2
processes runs the three layouts one after the other; the one-process reference runs in the test process.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.warm import context

pytestmark = pytest.mark.slow

BASE = ["model_type=INTERNLM2", "model.num_kv_attention_heads=2", "data.seq_len=32", "data.micro_bsz=2",
        "data.fixed_random_dataset_seqlen=False", "data.num_worker=0", "data.valid_every=0",
        "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.vocab_size=128",
        "model.multiple_of=32", "model.use_flash_attn=False", "model.dtype=torch.float32",
        "monitor.tensorboard=False", "ckpt.enable_save_ckpt=False", "ckpt.auto_resume=False"]
JOBS = {"reference": (1, ["data.micro_num=4"]),
        "dp2": (2, ["parallel.zero1=-1", "data.micro_num=2"]),
        "cp2": (2, ["parallel.context=2", "data.micro_num=4"]),
        "pp2": (2, ["parallel.pipeline=2", "data.micro_num=4"])}
REDUCTIONS = ("token_mean", "micro_batch_mean")
# fp32: the layouts sum the same products in another order (FSDP's reduce-scatter, the context ranks' attention)
TOL = 1e-6


def _uneven(labels: torch.Tensor, g: int) -> torch.Tensor:
    """Global micro-batch g's labels, made uneven: 0 all of the row's, 1 only its first 5 tokens (all in context
    rank 0's chunk), 2 every third, 3 none."""
    keep = torch.arange(labels.numel()).view_as(labels)
    keep = [keep >= 0, keep < 5, keep % 3 == 0, keep < 0][g]
    return torch.where(keep, labels, -100)


def _batch(trainer) -> dict:
    """This rank's batch of step 0, labels made uneven by global micro-batch."""
    batch = dict(trainer.train_loader.batch_at(0))
    n = batch["labels"].shape[0]
    batch["labels"] = torch.stack([_uneven(batch["labels"][i], trainer.dims.dp_rank * n + i) for i in range(n)])
    return batch


def _grads(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in model.named_parameters()}


def _by_hand(trainer, batch: dict) -> dict:
    """Both reductions of one process, written out: per-token cross entropy summed over the global batch and
    divided by its counted tokens; each micro-batch's token mean, averaged over the micro-batches."""
    out = {}
    for reduction in REDUCTIONS:
        trainer.model.zero_grad(set_to_none=True)
        sums, counts = [], []
        for mb in trainer._micro_batches(batch, batch["labels"].shape[0]):
            logits = trainer.model(mb["input_ids"], mb["position_ids"], mb["cu_seqlens"])
            sums.append(F.cross_entropy(logits.flatten(0, -2).float(), mb["labels"].flatten(), reduction="sum"))
            counts.append(int((mb["labels"] != -100).sum()))
        if reduction == "token_mean":
            loss = torch.stack(sums).sum() / sum(counts)
        else:
            loss = torch.stack([s / max(c, 1) for s, c in zip(sums, counts)]).mean()
        loss.backward()
        out[reduction] = {"loss": loss.item(), "grads": _grads(trainer.model), "counts": counts}
    return out


def run_job(name: str, launch, root: Path) -> None:
    """Build the job's trainer; one forward/backward of the uneven batch per reduction; record grads and loss."""
    from internlm_core.config import load_config
    from internlm_core.trainer.build import build_trainer, resolve_run_dir

    cfg = load_config("configs/tiny.py", BASE + JOBS[name][1], world_size=launch.world_size)
    trainer = build_trainer(cfg, launch, resolve_run_dir(cfg, str(root / name / "run"), launch))
    batch = _batch(trainer)
    record: dict = {"pp_rank": trainer.dims.pp_rank}
    if name == "reference":
        record["by_hand"] = _by_hand(trainer, batch)
    for reduction in REDUCTIONS:
        trainer.loop = dataclasses.replace(trainer.loop, loss_reduction=reduction)
        trainer.model.zero_grad(set_to_none=True)
        trainer.model.train()
        loss = trainer._reduce_loss(trainer.forward_backward(batch))
        record[reduction] = {"loss": loss, "grads": _grads(trainer.model)}
    (root / name).mkdir(parents=True, exist_ok=True)
    torch.save(record, root / name / f"rank{launch.rank}.pt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    root = tmp_path_factory.mktemp("reduction")
    worker(0, 1, 0, ["reference"], str(root))
    context()
    mp.start_processes(worker, args=(2, free_port(), [n for n in JOBS if n != "reference"], str(root)), nprocs=2,
                       start_method="forkserver", join=True)
    return lambda name: [torch.load(root / name / f"rank{r}.pt", weights_only=False) for r in range(JOBS[name][0])]


def test_the_batch_is_uneven_and_the_reductions_differ(runs):
    hand = runs("reference")[0]["by_hand"]
    counts = hand["token_mean"]["counts"]
    assert counts[3] == 0 and 0 < counts[1] <= 5 and counts[0] > counts[2] > counts[1], counts
    assert abs(hand["token_mean"]["loss"] - hand["micro_batch_mean"]["loss"]) > 0.5


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", list(JOBS))
def test_each_layout_gives_the_gradient_of_the_one_process_loss(runs, name, reduction):
    hand = runs("reference")[0]["by_hand"][reduction]
    recs = runs(name)
    grads: dict[str, torch.Tensor] = {}
    for rec in recs:  # pipeline stages hold different layers; ranks holding the same parameter agree
        for n, g in rec[reduction]["grads"].items():
            if n in grads:
                torch.testing.assert_close(g, grads[n], rtol=0, atol=TOL)
            grads[n] = g
        assert rec[reduction]["loss"] == pytest.approx(hand["loss"], rel=TOL), (rec[reduction]["loss"], hand["loss"])
    assert grads.keys() == hand["grads"].keys()
    worst = max((grads[n] - hand["grads"][n]).abs().max().item() for n in grads)
    scale = max(g.abs().max().item() for g in hand["grads"].values())
    assert worst <= TOL * max(scale, 1.0), (worst, scale)
