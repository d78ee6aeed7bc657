"""Write an internlm-core checkpoint as an InternLM checkpoint folder, which InternLM's own loading
(`load_ckpt_info=dict(path=..., content=("model",), ckpt_type="internlm")`) and its
tools/transformers/convert2hf.py read.

    python tools/convert2internlm.py CKPT_DIR OUT_DIR                    # one file: model_tp0_pp0.pt
    python tools/convert2internlm.py CKPT_DIR OUT_DIR --tp 2 --pp 2      # split as a tensor 2 x pipeline 2 run saves
    python tools/convert2internlm.py CKPT_DIR OUT_DIR --dtype float32

CKPT_DIR is one checkpoint written by training (any data/tensor/pipeline layout), or the run's save_ckpt_folder
(its newest complete checkpoint is taken). OUT_DIR gets model_tp{t}_pp{p}.pt (InternLM's module names under
"model.", layers numbered from 0 on every stage) and model_config.pt. INTERNLM models write InternLM v1's names
(blocks.N.mixer.Wqkv, ...), INTERNLM2 models InternEvo's (layers.N.attention.wqkv, ...). The model only: InternLM's
optimizer state has no counterpart here.
"""

from __future__ import annotations

import argparse
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Write an internlm-core checkpoint as an InternLM checkpoint folder.")
    p.add_argument("ckpt_dir", metavar="CKPT_DIR", help="a checkpoint folder written by train.py, or the "
                                                        "save_ckpt_folder (its newest complete checkpoint)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the InternLM folder to write (created if needed)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel shards to write (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages to write (default 1)")
    p.add_argument("--config", default=None, help="config of the run (default: the one recorded in the checkpoint)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="override keys of --config")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="dtype of the written weights (default: the run's model.dtype)")
    p.add_argument("--allow-incomplete", action="store_true",
                   help="read a DCP folder that has no COMPLETE marker")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from internlm_core.checkpoint.internlm_format import export_internlm_checkpoint
    from internlm_core.config import load_config

    cfg = load_config(args.config, args.set) if args.config else None
    t0 = time.perf_counter()
    files = export_internlm_checkpoint(args.ckpt_dir, args.out_dir, cfg=cfg, tp=args.tp, pp=args.pp,
                                       dtype=args.dtype, allow_incomplete=args.allow_incomplete,
                                       progress=lambda msg: print(msg, flush=True))
    total = sum(f.stat().st_size for f in files)
    print(f"wrote {len(files)} files ({total / 1e6:.1f} MB) to {args.out_dir} in {time.perf_counter() - t0:.1f} s")
    for f in files:
        print(f"  {f.name}")
    return 0


if __name__ == "__main__":
    from internlm_core.utils.cli import run_main

    run_main(main)
