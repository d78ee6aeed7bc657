"""The fused output head + cross entropy under tensor parallel 2 (two gloo ranks; this file is also the driver
each rank runs): the head weight a DTensor sharded by vocabulary rows (ColwiseParallel's layout, through
FusedHead as the trainer uses it), the per-chunk max / sum of exponentials / label logit all-reduced over the
tensor group. The loss, the metrics' cross entropy and argmax, the hidden states' gradient and each rank's rows of
the weight's gradient equal the one-process unfused head (F.linear + cross entropy) to 1e-5 in fp32, with label
smoothing and z-loss; under sequence parallel too (each rank's input its slice of the sequence, its gradient that
slice's)."""

from __future__ import annotations

import pytest

from tests.helpers.launch import ROOT, env

pytestmark = pytest.mark.slow


def test_fused_head_tensor_parallel_2_equals_one_process():
    from tests.helpers import warm
    p = warm.run(str(ROOT / "tests/dist/test_fused_head_tp.py"), [], env(), ROOT, timeout=120, nproc=2)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert p.stdout.count(": ok") == 2, p.stdout


def test_train_py_pipeline_fused_head_equals_unfused(tmp_path):
    """train.py on configs/tiny.py at pipeline parallel 2 x 2 chunks (interleaved: the last stage's chunk a module of
    its own) with label smoothing: the fused head's step losses and metrics are the unfused head's (measured: the
    same to 1e-7; by hand also at tensor 2 + sequence parallel, and tensor 2 x pipeline 2 + sequence parallel)."""
    from tests.helpers.launch import read_metrics, run_train
    runs = {}
    for fused in (True, False):
        run = tmp_path / f"fused_{fused}"
        p = run_train(["--config", "configs/tiny.py", "--run-dir", str(run), "--set", f"model.fused_head_loss={fused}",
                       "parallel.pipeline=2", "model.num_chunks=2", "model.num_layers=4", "data.micro_num=4",
                       "data.total_steps=3", "lr_scheduler.total_steps=3", "data.valid_every=0",
                       "monitor.tensorboard=False", "loss.label_smoothing=0.1"], nproc=2)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        runs[fused] = read_metrics(run)
    assert len(runs[True]) == len(runs[False]) == 3
    for a, b in zip(runs[True], runs[False]):
        for key in ("loss", "acc", "ppl", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (key, a[key], b[key])


def check(rank: int, smoothing: float, z: float) -> None:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import internlm_core.fused_head as fused_head
    from internlm_core.fused_head import FusedHead

    fused_head.CHUNK_BYTES["cpu"] = 4 * 50 * 6  # chunks of 6 rows of the 50 local columns
    g = torch.Generator().manual_seed(0)  # the same on both ranks
    n, h, vocab = 31, 16, 100
    x = torch.randn(n, h, generator=g)
    w = 0.5 * torch.randn(vocab, h, generator=g)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[[2, 9]] = -100
    labels[5], labels[6] = 10, 90  # one label in each rank's rows at least
    valid = labels != -100

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    logits = F.linear(xr, wr)
    lse = torch.logsumexp(logits, dim=-1)
    ref = (F.cross_entropy(logits, labels, ignore_index=-100, reduction="none", label_smoothing=smoothing)
           + z * lse * lse * valid).sum() / valid.sum()
    ref.backward()

    model = nn.Module()
    model.output = nn.Linear(h, vocab, bias=False)
    mesh = init_device_mesh("cpu", (2,))
    model.output.weight = nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))
    xf = x.clone().requires_grad_()
    token_losses, ce, argmax = FusedHead(model)(xf, labels, smoothing, z)
    loss = token_losses.sum() / valid.sum()
    loss.backward()
    tol = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, ref.detach(), **tol)
    torch.testing.assert_close(ce, F.cross_entropy(logits.detach(), labels, ignore_index=-100, reduction="none"), **tol)
    assert torch.equal(argmax, logits.detach().argmax(dim=-1))
    torch.testing.assert_close(xf.grad, xr.grad, **tol)
    grad_w = model.output.weight.grad
    assert grad_w.placements == (Shard(0),), grad_w.placements
    torch.testing.assert_close(grad_w.to_local(), wr.grad[rank * 50:(rank + 1) * 50], **tol)

    # sequence parallel: [1, 31 + 1 tokens] cut along the sequence, this rank's 16 rows in, the full labels
    xs = torch.cat([x, x[:1]]).unsqueeze(0)
    ls = torch.cat([labels, labels[:1]]).unsqueeze(0)
    xsr, wsr = xs.clone().requires_grad_(), w.clone().requires_grad_()
    logits = F.linear(xsr, wsr)
    vs = ls != -100
    ref = (F.cross_entropy(logits.flatten(0, 1), ls.flatten(), ignore_index=-100, reduction="none",
                           label_smoothing=smoothing) + z * torch.logsumexp(logits, -1).flatten() ** 2 * vs.flatten())
    (ref.sum() / vs.sum()).backward()
    model.output.weight.grad = None
    mine = xs[:, rank * 16:(rank + 1) * 16].clone().requires_grad_()
    token_losses, _, _ = FusedHead(model, sequence_parallel=True)(mine, ls, smoothing, z)
    (token_losses.sum() / vs.sum()).backward()
    torch.testing.assert_close(token_losses, ref.detach(), **tol)
    torch.testing.assert_close(mine.grad, xsr.grad[:, rank * 16:(rank + 1) * 16], **tol)
    torch.testing.assert_close(model.output.weight.grad.to_local(), wsr.grad[rank * 50:(rank + 1) * 50], **tol)


def main() -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for smoothing, z in ((0.0, 0.0), (0.1, 1e-3)):
        check(rank, smoothing, z)
    print(f"rank {rank}: ok")


if __name__ == "__main__":
    main()
