"""Two-rank driver (gloo): the per-step collectives of a two-stage pipeline (rank 0: the first stage, without outputs;
rank 1: the last), run under the device audit as if on CUDA (tests/helpers/device_audit.py). Prints one JSON line of
what they gave per rank; a tensor on the wrong device fails the run with DevicePlacementError."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402

from internlm_core.distributed import ParallelDims  # noqa: E402
from tests.helpers.device_audit import audit_devices  # noqa: E402
from tests.helpers.stage_collectives import stage_step_collectives, summary  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dims = ParallelDims(world_size=2, pp=2)
    dims.build_mesh("cpu")
    with audit_devices("cuda") as device:
        result = stage_step_collectives(device, last=dims.pp_rank == 1, dims=dims, world_size=2, rank=rank)
    print(json.dumps({"rank": rank, "pp_rank": dims.pp_rank, **summary(result)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
