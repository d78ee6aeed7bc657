"""One rank of 16 (PyTorch's fake process group) of a tiny MIXTRAL under expert parallel: argv = rank, experts,
expert-parallel size. Prints one JSON line: each expert weight's placements and local shape, whether init fell back
to drawing a whole parameter, and whether every local element equals the unsharded model's element there."""

import json
import logging
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from internlm_core.config import load_config  # noqa: E402
from internlm_core.distributed.simulate import init_simulated  # noqa: E402
from internlm_core.model import build_model  # noqa: E402
from internlm_core.model.init import shard_indices  # noqa: E402
from internlm_core.trainer.build import build_trainer  # noqa: E402


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def main() -> None:
    rank, experts, ep = (int(a) for a in sys.argv[1:4])
    cfg = load_config("configs/tiny.py", ["model_type=MIXTRAL", f"model.num_experts={experts}", "moe.top_k=2",
                                          f"parallel.expert={ep}", "model.num_kv_attention_heads=4",
                                          "parallel.zero1=-1", "ckpt.enable_save_ckpt=False",
                                          "ckpt.auto_resume=False"], world_size=16)
    warnings = Warnings()
    logging.getLogger("internlm_core").addHandler(warnings)
    trainer = build_trainer(cfg, init_simulated(16, rank), Path(tempfile.mkdtemp()))
    whole = build_model(cfg)  # one process, no sharding: the values every layout must start from
    reference = dict(whole.named_parameters())
    out = {}
    for name, p in trainer.model.named_parameters():
        if ".experts." not in name:
            continue
        index = shard_indices(p)
        local = p.to_local()
        same = index is not None and torch.equal(local, reference[name][torch.meshgrid(*index, indexing="ij")])
        out[name] = {"placements": [repr(x) for x in p.placements], "local": list(local.shape), "same": same}
    print(json.dumps({"params": out, "whole_draws": [w for w in warnings.lines if "whole parameter" in w]}))


if __name__ == "__main__":
    main()
