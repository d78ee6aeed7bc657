"""An MoE family under context parallel trains like one process (issue 36 item 8), on a stack with a dense block
(issue 36 item 5): QWEN3_MoE, block 0 dense (model.first_k_dense_replace=1), block 1 a dropless top-2 MoE with the
load-balancing loss, the router z-loss and aux-loss-free expert bias on. CP 2 (ring and all_to_all, FSDP over the 2
context ranks) and expert parallel 2 (FSDP, data parallel 2) give the losses, gradient norms, the step's aux and z
losses, the load metrics and the expert bias after every step of one process on the same global batch (fp32,
within 1e-5), gloo on CPU. DEEPSEEK_V3 (latent attention, sigmoid group-limited routing, a shared expert) at CP 2
(ring) likewise.

The global batch is 2 micro-batches of one 64-token row; all jobs of one world size run in one process group, one
after the other, as tests/dist/test_context_parallel.py does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.dist.test_context_parallel import free_port
from tests.helpers.warm import context

pytestmark = pytest.mark.slow

STEPS = 4
BASE = ["model_type=QWEN3_MoE", "model.num_layers=2", "model.first_k_dense_replace=1", "model.hidden_size=64",
        "model.num_attention_heads=4", "model.num_kv_attention_heads=2", "model.head_dim=16",
        "model.vocab_size=128", "model.intermediate_size=96", "model.moe_intermediate_size=32",
        "model.num_experts=4", "moe.top_k=2", "model.moe_type=Dropless", "moe.z_loss_coeff=0.01",
        "moe.expert_bias_update_rate=0.01", "loss.moe_loss_coeff=0.05", "model.use_flash_attn=False",
        "model.dtype=torch.float32", "data.seq_len=64", "data.micro_bsz=1", "data.micro_num=2",
        "data.fixed_random_dataset_seqlen=False", "data.valid_every=0", "data.num_worker=0",
        f"data.total_steps={STEPS}", "data.empty_cache_and_diag_interval=100", "monitor.tensorboard=False",
        "monitor.log_every=100", "adam.lr=2e-3", "ckpt.enable_save_ckpt=False", "ckpt.auto_resume=False"]
# DEEPSEEK_V3 (issue 36's check "CP2 equals one process"): latent attention with low-rank queries, a dense first
# block, group-limited sigmoid routing with a shared expert and the aux-loss-free bias, the same data and steps
DEEPSEEK = [o for o in BASE if not o.startswith(("model_type", "model.num_kv_attention_heads", "model.head_dim",
                                                 "model.num_layers", "model.intermediate_size"))] + [
    "model_type=DEEPSEEK_V3", "model.num_layers=3", "model.intermediate_size=64", "model.q_lora_rank=24",
    "model.kv_lora_rank=16", "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8", "model.v_head_dim=12",
    "model.num_shared_experts=1", "moe.score_func=sigmoid", "moe.num_expert_groups=2", "moe.top_k_groups=1",
    "moe.routed_scaling_factor=2.5"]
# name: (processes, overrides); the references are one process
JOBS = {
    "reference": (1, []),
    "cp2_ring": (2, ["parallel.context=2"]),
    "cp2_a2a": (2, ["parallel.context={'size': 2, 'mode': 'all_to_all'}"]),
    "ep2": (2, ["parallel.expert=2", "parallel.zero1=-1", "data.micro_num=1"]),
    "deepseek_reference": (1, []),
    "deepseek_cp2_ring": (2, ["parallel.context=2"]),
}
KEYS = ("loss", "grad_norm", "moe/aux_loss", "moe/layer1/z_loss", "moe/layer1/max_load", "moe/layer1/min_load")


def run_job(name: str, launch, root: Path) -> None:
    """One job on this process group: train through build_trainer / Trainer.train, recording each step's metrics
    and the MoE layer's expert bias after it."""
    from internlm_core.callbacks import TrainerCallback
    from internlm_core.config import load_config
    from internlm_core.model.moe import moe_layers
    from internlm_core.trainer.build import build_trainer, resolve_run_dir

    base = DEEPSEEK if name.startswith("deepseek") else BASE
    cfg = load_config("configs/tiny.py", base + JOBS[name][1], world_size=launch.world_size)
    record: dict = {}

    class Record(TrainerCallback):
        def on_step_end(self, trainer, metrics):
            bias = [m.gate.expert_bias.detach().cpu().clone() for m in moe_layers(trainer.model)]
            record[metrics["step"]] = ({k: metrics[k] for k in KEYS}, bias)

    trainer = build_trainer(cfg, launch, resolve_run_dir(cfg, str(root / name / "run"), launch),
                            extra_callbacks=[Record()])
    kinds = [type(b.feed_forward).__name__ for b in trainer.model.layers.values()]
    params = dict(trainer.model.named_parameters())
    meshes = {n: getattr(getattr(params.get(n), "device_mesh", None), "mesh_dim_names", None)
              for n in ("layers.0.feed_forward.w1.weight", "layers.1.feed_forward.experts.w1")}
    trainer.train()
    (root / name).mkdir(parents=True, exist_ok=True)
    torch.save({"steps": record, "kinds": kinds, "cp": trainer.dims.cp, "meshes": meshes},
               root / name / f"rank{launch.rank}.pt")


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
    root = tmp_path_factory.mktemp("moe_context")
    worker(0, 1, 0, ["reference", "deepseek_reference"], str(root))
    context()
    mp.start_processes(worker, args=(2, free_port(), [n for n in JOBS if JOBS[n][0] == 2], str(root)), nprocs=2,
                       start_method="forkserver", join=True)
    return lambda name: [torch.load(root / name / f"rank{r}.pt", weights_only=False) for r in range(JOBS[name][0])]


@pytest.mark.parametrize("name", [n for n in JOBS if "reference" not in n and not n.startswith("deepseek")])
def test_moe_with_a_dense_block_matches_one_process(runs, name):
    recs, ref = runs(name), runs("reference")[0]
    assert ref["kinds"] == ["FeedForward", "MoEFeedForward"] == recs[0]["kinds"]
    assert recs[0]["cp"] == (2 if name.startswith("cp2") else 1)
    # FSDP's meshes: the dense block's FFN over every data x context rank, the experts over what "ep" leaves (x cp)
    dense_ffn, experts = recs[0]["meshes"].values()
    assert dense_ffn == ("dp_shard_cp",) and experts == (("dp_shard_rest", "ep") if name == "ep2" else
                                                        ("dp_shard_cp",)), recs[0]["meshes"]
    assert ref["steps"][STEPS][0]["loss"] < ref["steps"][1][0]["loss"]
    for step in range(1, STEPS + 1):
        want, want_bias = ref["steps"][step]
        assert want["moe/aux_loss"] > 0 and want["moe/layer1/z_loss"] > 0 and want_bias[0].abs().sum() > 0
        for r, rec in enumerate(recs):
            got, bias = rec["steps"][step]
            for k in KEYS:
                assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), (name, r, step, k, got[k], want[k])
            # the bias moves by +-rate per step: the same sign of (mean - load) as one process saw, every expert
            assert torch.allclose(bias[0], want_bias[0], atol=1e-6), (name, r, step, bias, want_bias)


def test_deepseek_v3_under_context_parallel_matches_one_process(runs):
    """DEEPSEEK_V3 at CP 2 (ring): the latent attention's chunks and the routing statistics summed over the context
    ranks give one process's losses, norms, MoE metrics and expert bias, every step."""
    recs, ref = runs("deepseek_cp2_ring"), runs("deepseek_reference")[0]
    assert recs[0]["cp"] == 2 and ref["kinds"][0] != ref["kinds"][1]  # a dense block, then MoE ones
    for step in range(1, STEPS + 1):
        want, want_bias = ref["steps"][step]
        for r, rec in enumerate(recs):
            got, bias = rec["steps"][step]
            for k in KEYS:
                assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), (r, step, k, got[k], want[k])
            assert all(torch.allclose(b, w, atol=1e-6) for b, w in zip(bias, want_bias)), (r, step)
