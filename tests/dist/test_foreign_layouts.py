"""Foreign weights into every layout: a Hugging Face folder, an InternLM folder, an InternEvo folder and a Meta
Llama folder, named by `ckpt.load_ckpt_info` as users' configs name them, load into data parallel (FSDP),
tensor parallel, pipeline parallel, pipeline x FSDP and pipeline x tensor parallel (4 ranks) through
build_trainer's resume; every parameter, gathered to its full tensor, equals the one-process load bitwise.

Before the fix, rank 0 read only its own pipeline stage's names and kept only its own keys: later stages got
nothing ("missing 11 tensor(s) ... layers.1.*" under pipeline 2 x FSDP 2). All jobs of one world size run in one
process group, one after the other (one launch per world size).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from tests.helpers.warm import context

pytestmark = pytest.mark.slow

SHAPE = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.vocab_size=96",
         "model.dtype=torch.float32", "model.use_flash_attn=False", "data.seq_len=32", "data.total_steps=1",
         "data.dummy_num_samples=64", "data.valid_every=0", "monitor.tensorboard=False"]
# format: (model_type, ckpt_type as the user's config writes it, the family's model keys)
FORMATS = {
    "hf": ("LLAMA", "hf", ["model.num_kv_attention_heads=2", "model.intermediate_size=192"]),
    "internlm": ("INTERNLM", "internlm", ["model.intermediate_size=192"]),  # bias on q/k/v/o, tp 2 x pp 2 files
    "internevo": ("INTERNLM2", "internevo", ["model.num_kv_attention_heads=2", "model.intermediate_size=192"]),
    "meta": ("LLAMA", "LLAMA", []),  # InternEvo's spelling; the shape comes from params.json
}
# layout: (processes, overrides)
LAYOUTS = {
    "dp2": (2, ["parallel.zero1=-1"]),
    "tp2": (2, ["parallel.tensor=2"]),
    "pp2": (2, ["parallel.pipeline=2", "data.micro_num=2"]),
    "pp2_fsdp2": (4, ["parallel.pipeline=2", "parallel.zero1=-1", "data.micro_num=2"]),
    "pp2_tp2": (4, ["parallel.pipeline=2", "parallel.tensor=2", "data.micro_num=2"]),
}
JOBS = [(f, lay) for lay in LAYOUTS for f in FORMATS]


def model_sets(fmt: str, root: Path) -> list[str]:
    from internlm_core.checkpoint.pth_shards import config_from_pth_folder
    model_type, _, extra = FORMATS[fmt]
    if fmt == "meta":
        extra = [f"model.{k}={v}" for k, v in config_from_pth_folder(root / "meta").items()]
    return [f"model_type={model_type}", *SHAPE, *extra]


def write_folders(root: Path) -> None:
    """The four foreign folders, from random weights (norms and biases too)."""
    from internlm_core.checkpoint.hf import export_hf
    from internlm_core.checkpoint.internlm_format import write_internlm_folder
    from internlm_core.config import load_config
    from internlm_core.model import build_model
    from tests.helpers.meta_llama import LLAMA3, meta_weights, write_meta_folder

    for fmt, seed in (("hf", 1), ("internlm", 2), ("internevo", 3)):
        cfg = load_config("configs/tiny.py", model_sets(fmt, root))
        torch.manual_seed(seed)
        model = build_model(cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        sd = model.state_dict()
        if fmt == "hf":
            export_hf(root / fmt, cfg, sd, dtype="float32", tokenizer=None)
        else:  # InternLM saved by tensor 2 x pipeline 2, InternEvo by pipeline 2: another split than any reader's
            write_internlm_folder(root / fmt, cfg, sd, tp=2 if fmt == "internlm" else 1, pp=2, dtype="float32")
    write_meta_folder(root / "meta", LLAMA3, meta_weights(LLAMA3, seed=4), mp=2, embed_dim=0)


def one_process(fmt: str, root: Path) -> dict[str, torch.Tensor]:
    """The reference: the folder loaded into the plain model of one process."""
    from internlm_core.checkpoint import FOREIGN_LOADERS
    from internlm_core.config import load_config
    from internlm_core.config.ckpt_names import CKPT_TYPE_ALIASES
    from internlm_core.model import build_model

    model_type, kind, _ = FORMATS[fmt]
    model = build_model(load_config("configs/tiny.py", model_sets(fmt, root)))
    kind = CKPT_TYPE_ALIASES.get(kind.lower(), kind.lower())
    FOREIGN_LOADERS[kind](model, root / fmt, model_type)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run_job(fmt: str, layout: str, launch, root: Path) -> None:
    from torch.distributed.tensor import DTensor
    from internlm_core.config import load_config
    from internlm_core.trainer.build import build_trainer, resolve_run_dir

    _, kind, _ = FORMATS[fmt]
    info = {"path": str(root / fmt), "content": ("model",), "ckpt_type": kind}
    sets = [*model_sets(fmt, root), *LAYOUTS[layout][1], "ckpt.auto_resume=False", f"ckpt.load_ckpt_info={info!r}"]
    cfg = load_config("configs/tiny.py", sets, world_size=launch.world_size)
    out = root / f"{fmt}_{layout}"
    trainer = build_trainer(cfg, launch, resolve_run_dir(cfg, str(out / "run"), launch))
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
              for n, p in trainer.model.named_parameters()}
    torch.save({"params": params, "pp_rank": trainer.dims.pp_rank}, out / f"rank{launch.rank}.pt")


def worker(rank: int, world: int, port: int, jobs: list[tuple[str, str]], root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from internlm_core.distributed import destroy_distributed, init_distributed
    launch = init_distributed("torch", timeout_s=120)
    for fmt, layout in jobs:
        run_job(fmt, layout, launch, Path(root))
    destroy_distributed()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    import torch.multiprocessing as mp
    root = tmp_path_factory.mktemp("foreign")
    write_folders(root)
    for world in sorted({w for w, _ in LAYOUTS.values()}):
        jobs = [(f, lay) for f, lay in JOBS if LAYOUTS[lay][0] == world]
        context()  # forks of a warm interpreter (tests/helpers/warm.py)
        mp.start_processes(worker, args=(world, free_port(), jobs, str(root)), nprocs=world,
                           start_method="forkserver", join=True)
    return root


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_layout_loads_what_one_process_loads(loads, fmt):
    ref = one_process(fmt, loads)
    for layout, (world, _) in LAYOUTS.items():
        records = [torch.load(loads / f"{fmt}_{layout}" / f"rank{r}.pt", weights_only=False) for r in range(world)]
        merged: dict[str, torch.Tensor] = {}
        for r, rec in enumerate(records):
            for n, t in rec["params"].items():
                assert n not in merged or torch.equal(merged[n], t), f"{fmt} {layout}: rank {r} disagrees on {n}"
                merged[n] = t
        assert sorted(merged) == sorted(ref), f"{fmt} {layout}: {sorted(set(merged) ^ set(ref))}"
        wrong = [n for n in ref if not torch.equal(merged[n], ref[n])]
        assert not wrong, f"{fmt} {layout}: {len(wrong)} parameter(s) differ from one process, e.g. {wrong[:3]}"
        if layout.startswith("pp2"):  # each stage holds its own layers only
            stages = {rec["pp_rank"]: set(rec["params"]) for rec in records}
            assert "layers.1.attention.wq.weight" in stages[1] - stages[0]
