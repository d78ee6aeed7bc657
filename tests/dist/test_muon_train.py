"""train.py with optimizer.name=muon on a MoE model (gloo, CPU): expert parallel 2 (experts Shard(0) by expert,
FSDP2 over the rest), tensor parallel 2 (attention and routers cut by rows and columns: gathered whole) and FSDP2 2
train as one process on the same global batch: per-step losses and gradient norms within 1e-5 relative (the
layouts sum the same fp32 products in another order, as tests/dist/test_moe_family.py bounds for AdamW). The
optimizer-level equality (bitwise, same gradients) is tests/dist/test_muon_dist.py's."""

import pytest

from tests.helpers.launch import read_metrics, run_train

pytestmark = pytest.mark.slow

STEPS = 6
MOE = ["model_type=INTERNLM_MoE", "model.num_experts=4", "moe.top_k=2", "model.dtype=torch.float32",
       "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.vocab_size=128",
       "model.multiple_of=32", "data.seq_len=64", "data.micro_bsz=2", "data.valid_every=0",
       f"data.total_steps={STEPS}", f"lr_scheduler.total_steps={STEPS}", "adam.lr=2e-3",
       "data.fixed_random_dataset_seqlen=False", "monitor.log_every=100", "monitor.tensorboard=False",
       "model.moe_type=Dropless", "optimizer.name=muon"]


def _run(tmp_path, name, nproc, extra):
    run = tmp_path / name
    p = run_train(["--config", "configs/tiny.py", "--run-dir", str(run), "--set", *MOE, *extra], nproc=nproc)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # per layer: wq, wk, wv, wo and the 3-D experts w1, w3, w2; AdamW: embedding, head, norms, biases, routers
    assert "optimizer: Muon for 14 matrices of the blocks" in p.stdout and "AdamW (single-tensor) for 17" in p.stdout
    return read_metrics(run)


def _close(a, b, what) -> float:
    assert len(a) == len(b), what
    for step, (x, y) in enumerate(zip(a, b), 1):
        assert abs(x - y) <= 1e-5 * max(1.0, abs(x)), (what, step, x, y)
    return max(abs(x - y) / max(1.0, abs(x)) for x, y in zip(a, b))


def test_muon_layouts_train_as_one_process(tmp_path):
    ref = _run(tmp_path, "one", 1, ["data.micro_num=4", "parallel.zero1=1"])
    losses = [r["loss"] for r in ref]
    assert losses[-1] < losses[0]
    for name, extra in (("fsdp2", ["parallel.zero1=-1", "data.micro_num=2"]),
                        ("ep2", ["parallel.zero1=-1", "parallel.expert=2", "data.micro_num=2"]),
                        ("tp2", ["parallel.tensor=2", "data.micro_num=4"])):
        records = _run(tmp_path, name, 2, extra)
        worst = _close(losses, [r["loss"] for r in records], f"{name} loss")
        worst_norm = _close([r["grad_norm"] for r in ref], [r["grad_norm"] for r in records], f"{name} grad_norm")
        print(f"{name}: max relative difference to one process: loss {worst:.2g}, grad_norm {worst_norm:.2g}")
