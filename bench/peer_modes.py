#!/usr/bin/env python
"""The peers of ../shared/bench/peers in another mode (bf16, torch.compile), without copying their code.

    python bench/peer_modes.py PEERS_DIR PEER MODE OUT_DIR

PEER is bare_loop or hf_trainer; MODE is fp32, bf16, compile or bf16_compile. Only the mode changes:
- bare_loop: the peer's own `Llama` and `lm_loss` in the peer's own `workload.plain_loop`; bf16 wraps the loss
  function (forward + loss) in `torch.autocast("cpu", torch.bfloat16)`, compile uses `torch.compile(model)`.
- hf_trainer: the peer's script itself, run with `TrainingArguments(..., bf16=True)` and/or `torch_compile=True`
  added to the arguments it builds (transformers.TrainingArguments is wrapped before the script imports it).
The results JSON keeps the peer's name and format (`workload.Recorder`), written into OUT_DIR.
"""

from __future__ import annotations

import os
import runpy
import sys


def extra_args(mode: str) -> dict:
    return {"bf16": mode in ("bf16", "bf16_compile"), "compile": mode in ("compile", "bf16_compile")}


def run_bare_loop(peers: str, mode: str, out_dir: str) -> None:
    import torch

    import bare_loop as B
    import workload as W

    x = extra_args(mode)
    torch.manual_seed(W.INIT_SEED)
    model = B.Llama()
    fwd = torch.compile(model) if x["compile"] else model

    def loss_fn(ids):
        if x["bf16"]:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return B.lm_loss(fwd(ids), ids)
        return B.lm_loss(fwd(ids), ids)

    sys.argv = [os.path.join(peers, "bare_loop.py"), out_dir]
    W.plain_loop("bare_loop", model, loss_fn)


def run_hf_trainer(peers: str, mode: str, out_dir: str) -> None:
    import transformers

    x = extra_args(mode)
    original = transformers.TrainingArguments

    class TrainingArguments(original):  # a subclass: dataclass fields and validation stay the Trainer's own
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("bf16", x["bf16"])
            kwargs.setdefault("torch_compile", x["compile"])
            super().__init__(*args, **kwargs)

    transformers.TrainingArguments = TrainingArguments
    sys.argv = [os.path.join(peers, "hf_trainer.py"), out_dir]
    runpy.run_path(os.path.join(peers, "hf_trainer.py"), run_name="__main__")


def main(argv: list[str]) -> int:
    if len(argv) != 4 or argv[1] not in ("bare_loop", "hf_trainer") or \
            argv[2] not in ("fp32", "bf16", "compile", "bf16_compile"):
        print(__doc__, file=sys.stderr)
        return 2
    peers, peer, mode, out_dir = os.path.abspath(argv[0]), argv[1], argv[2], os.path.abspath(argv[3])
    sys.path.insert(0, peers)
    os.chdir(peers)  # as run_all.sh does
    (run_bare_loop if peer == "bare_loop" else run_hf_trainer)(peers, mode, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
