"""Export an internlm-core checkpoint as a Hugging Face folder (config.json, safetensors, tokenizer).

    python tools/convert2hf.py CKPT_DIR OUT_DIR                      # dtype of the run, tokenizer of the run
    python tools/convert2hf.py CKPT_DIR OUT_DIR --dtype float32 --max-shard-size 2GB
    python tools/convert2hf.py CKPT_DIR OUT_DIR --tokenizer path/to/tokenizer.model

CKPT_DIR is one checkpoint written by training (any data/tensor/pipeline layout), or the run's save_ckpt_folder
(its newest complete checkpoint). Then, with transformers:

    AutoModelForCausalLM.from_pretrained(OUT_DIR); AutoTokenizer.from_pretrained(OUT_DIR)

INTERNLM, INTERNLM2, LLAMA and LLAMA3 export to LlamaForCausalLM by default: INTERNLM (v1) with attention_bias=true
(q/k/v/o bias), the others with num_key_value_heads for grouped-query attention; the other families to their own
class (QWEN2: Qwen2ForCausalLM, QWEN3, MISTRAL, MIXTRAL, QWEN3_MoE likewise). `--hf-arch` writes a family's own
class instead, as InternLM's converters do (their remote modelling code reads it, with trust_remote_code=True):

    python tools/convert2hf.py CKPT_DIR OUT_DIR --hf-arch internlm     # InternLMForCausalLM (INTERNLM models)
    python tools/convert2hf.py CKPT_DIR OUT_DIR --hf-arch internlm2    # InternLM2ForCausalLM, packed wqkv
"""

from __future__ import annotations

import argparse
import time


from internlm_core.errors import InternLMCoreError  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Export an internlm-core checkpoint as a Hugging Face folder.")
    p.add_argument("ckpt_dir", metavar="CKPT_DIR",
                   help="a checkpoint folder written by train.py (e.g. llm_ckpts/200), or the save_ckpt_folder "
                        "(its newest complete checkpoint is taken); local or s3://bucket/prefix")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the Hugging Face folder to write (created if needed)")
    p.add_argument("--config", default=None,
                   help="config of the run (default: the one recorded in the checkpoint)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="override keys of that config")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="dtype of the exported weights (default: the run's model.dtype; float32 for fp32/tf32 runs)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--tokenizer", default="config",
                   help="'config' (default: the run's `tokenizer` key), 'none', 'byte', a SentencePiece .model "
                        "or a tokenizer.json")
    p.add_argument("--hf-arch", default=None,
                   help="Hugging Face class, by its config.json model_type: llama (LlamaForCausalLM; the default "
                        "of the families that have that form), internlm, internlm2, qwen2, qwen3, mistral, mixtral, "
                        "qwen3_moe, ... or native (the model family's own; the default of the others)")
    p.add_argument("--allow-incomplete", action="store_true",
                   help="read a DCP folder that has no COMPLETE marker (interrupted, or not written by train.py)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from internlm_core.checkpoint.hf import export_checkpoint
    from internlm_core.config import load_config

    cfg = load_config(args.config, args.set) if args.config else None
    if cfg is None and args.set:
        from internlm_core.checkpoint.catalog import checkpoint_config, local_checkpoint
        from internlm_core.config import build_config, config_to_dict
        from internlm_core.config.loader import apply_overrides, parse_overrides

        if "://" in args.ckpt_dir:
            raise InternLMCoreError("--set with an s3:// checkpoint: pass --config with the run's config instead")
        with local_checkpoint(args.ckpt_dir, args.allow_incomplete) as (folder, _):
            raw = config_to_dict(checkpoint_config(folder))
        cfg = build_config(apply_overrides(raw, parse_overrides(args.set)), source=f"{args.ckpt_dir} config")
    tokenizer = None if args.tokenizer == "none" else args.tokenizer
    t0 = time.perf_counter()
    files = export_checkpoint(args.ckpt_dir, args.out_dir, cfg=cfg, dtype=args.dtype,
                              max_shard_size=args.max_shard_size, tokenizer=tokenizer,
                              allow_incomplete=args.allow_incomplete, arch=args.hf_arch,
                              progress=lambda msg: print(msg, flush=True))
    total = sum(f.stat().st_size for f in files)
    print(f"wrote {len(files)} files ({total / 1e6:.1f} MB) to {args.out_dir} in {time.perf_counter() - t0:.1f} s")
    for f in files:
        print(f"  {f.name}")
    return 0


if __name__ == "__main__":
    from internlm_core.utils.cli import run_main

    run_main(main)
