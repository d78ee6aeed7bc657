"""The memory check on two gloo ranks (estimate/fit.py): every rank refuses when one does not fit, and the ranks of
one host share its RAM."""

import json
import os
import tempfile

import pytest
import torch.multiprocessing as mp

pytestmark = pytest.mark.slow


def _worker(rank: int, store_path: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from internlm_core.config import load_config
    from internlm_core.errors import ConfigError
    from internlm_core.estimate.fit import check_memory

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    result: dict = {}
    cfg = load_config("configs/tiny.py", world_size=2)
    # rank 1 is told it has 1 MiB (a tiny model needs tens): it cannot fit, so neither rank may go on
    cfg.memory_limit_gib = 1 / 1024 if rank == 1 else None
    try:
        check_memory(cfg, 2, rank, torch.device("cpu"), distributed=True)
        result["refused"] = None
    except ConfigError as e:
        result["refused"] = str(e)
    cfg.memory_limit_gib = None  # both measure the host: each gets half of what it has available
    worst = check_memory(cfg, 2, rank, torch.device("cpu"), distributed=True)
    result.update(verdict=worst.verdict, source=worst.source, free=worst.free)
    import psutil
    result["available"] = psutil.virtual_memory().available
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def test_one_rank_that_does_not_fit_stops_both_and_a_host_is_shared():
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(os.path.join(tmp, "store"), tmp), nprocs=2, start_method="fork")
        results = [json.load(open(f"{tmp}/rank{r}.json")) for r in (0, 1)]
    for r in results:
        assert r["refused"] is not None and r["refused"].startswith("memory: the estimator puts rank 1 at ")
        assert "per device (cpu, +/-15%) but 1.0 MiB is free (memory_limit_gib=0.000976562);" in r["refused"]
        assert r["verdict"] == "fits" and " / 2 ranks on " in r["source"]
        assert 0.4 * r["available"] < r["free"] < 0.6 * r["available"]  # half the host (measured moments apart)
