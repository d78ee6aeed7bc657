"""The random generator states of one process, as a Stateful saved per rank."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


class RNGState:
    """python `random`, numpy's global RandomState, torch CPU and (when in use) the current CUDA device's generator.

    Every part is a tensor or a plain number, so it loads with `weights_only=True`. `load_state_dict`
    restores the parts it is given (a checkpoint from a CPU run carries no CUDA state).
    """

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        algo, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        sd: dict[str, Any] = {
            "python": {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64),
                       "gauss": gauss},
            "numpy": {"algorithm": str(algo), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "torch_cpu": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = torch.cuda.get_rng_state()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if "python" in sd:
            p = sd["python"]
            random.setstate((int(p["version"]), tuple(int(x) for x in p["state"].tolist()), p["gauss"]))
        if "numpy" in sd:
            n = sd["numpy"]
            np.random.set_state((n["algorithm"], n["keys"].numpy().astype(np.uint32), int(n["pos"]),
                                 int(n["has_gauss"]), float(n["cached_gaussian"])))
        if "torch_cpu" in sd:
            torch.set_rng_state(sd["torch_cpu"].to(torch.uint8))
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state(sd["cuda"].to(torch.uint8))
