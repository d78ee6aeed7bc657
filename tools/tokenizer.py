#!/usr/bin/env python
"""Tokenize txt / json / jsonl files (or folder trees, optionally .gz) into `.bin` + `.bin.meta`.

Examples::

    # InternLM's command line keeps working (add --tokenizer for its SentencePiece model):
    python tools/tokenizer.py --text_input_path raw.jsonl --bin_output_path data/train/en/raw.bin \\
        --tokenizer V7_sft.model
    # a folder tree, 8 encoding threads, InternLM's output format:
    python tools/tokenizer.py --input raw/ --output data/train/ --tokenizer tokenizer.model --format internlm --workers 8
    # the built-in byte tokenizer (no file; ids 0..255 = UTF-8 bytes, BOS 256, EOS 257, PAD 258; vocab 259):
    python tools/tokenizer.py --input corpus.jsonl --output data/corpus.bin --tokenizer byte

Documents: txt → every non-empty stripped line; json/jsonl → the `--text-key` field of each record (default
`text`). `--internlm-compat` (or `--text-key ''`) tokenizes what InternLM's tools/tokenizer.py did instead: the
`json.dumps` of each json record and every raw jsonl line, JSON syntax included.

BOS/EOS: added around every document by default (InternLM's data: add_bos_token=True, add_eos_token=True);
`--no-add-bos` / `--no-add-eos` turn them off.

Output: ours by default (compact fixed-width ids, see internlm_core/data/formats.py), `--format internlm`, or
`--format megatron` (X.bin + X.idx as Megatron-LM / GPT-NeoX / NeMo read them, see internlm_core/data/megatron.py).
Files are written under a temporary name and renamed when complete; an existing output is replaced (InternLM's
tool appended to it). Errors print one line naming the file and line and exit with status 1; `--on-error skip`
skips bad lines (malformed JSON, missing text field, non-UTF-8) and empty files, and counts them in the summary.
"""

from __future__ import annotations

import argparse
import os
import sys


from internlm_core.errors import InternLMCoreError  # noqa: E402


def _default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text_input_path", "--input", dest="input", required=True,
                   help="input file (.txt, .json, .jsonl, optionally .gz) or folder")
    p.add_argument("--bin_output_path", "--output", dest="output", required=True,
                   help="output .bin file (for one input file) or folder (mirrors an input folder's tree)")
    p.add_argument("--tokenizer", default="byte",
                   help="'byte' (built-in, vocab 259; the default), a SentencePiece .model, a tokenizer.json, "
                        "or a folder holding one")
    p.add_argument("--text-key", "--text_key", dest="text_key", default="text",
                   help="json/jsonl field holding the text (default 'text'); '' tokenizes like InternLM "
                        "(whole json.dumps-ed record / raw jsonl line)")
    p.add_argument("--internlm-compat", action="store_true",
                   help="tokenize exactly what InternLM's tools/tokenizer.py did (same as --text-key '')")
    p.add_argument("--format", dest="fmt", choices=("ours", "internlm", "megatron"), default="ours",
                   help="output format: ours (compact binary, default), internlm ({\"tokens\": [...]} lines) or "
                        "megatron (X.bin + X.idx, Megatron-LM's indexed dataset)")
    p.add_argument("--add-bos", "--add_bos_token", dest="add_bos", action=argparse.BooleanOptionalAction,
                   default=True, help="put BOS before every document (default on)")
    p.add_argument("--add-eos", "--add_eos_token", dest="add_eos", action=argparse.BooleanOptionalAction,
                   default=True, help="put EOS after every document (default on)")
    p.add_argument("--bos-token", default=None, help="BOS token text (tokenizer.json only; default: guessed)")
    p.add_argument("--eos-token", default=None, help="EOS token text (tokenizer.json only; default: guessed)")
    p.add_argument("--workers", type=int, default=_default_workers(),
                   help="encoding threads (default: the CPUs this process may use)")
    p.add_argument("--on-error", "--on_error", dest="on_error", choices=("fail", "skip"), default="fail",
                   help="fail (default): stop at the first bad line; skip: skip bad lines and empty files, count them")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.workers < 1:
        print(f"error: --workers {args.workers}: expected >= 1", file=sys.stderr)
        return 2
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.workers))  # the `tokenizers` thread pool
    try:
        from internlm_core.data.text2bin import Options, describe_dtype, tokenize_paths
        from internlm_core.data.tokenizers import load_tokenizer

        compat = args.internlm_compat or args.text_key == ""
        tok = load_tokenizer(args.tokenizer, internlm_compat=compat, bos_token=args.bos_token,
                             eos_token=args.eos_token)
        if args.tokenizer == "byte" and not args.quiet:
            print("tokenizer: built-in byte tokenizer (vocab 259); pass --tokenizer MODEL for SentencePiece or "
                  "a tokenizer.json", file=sys.stderr)
        opts = Options(text_key=None if compat else args.text_key, add_bos=args.add_bos, add_eos=args.add_eos,
                       fmt=args.fmt, workers=args.workers, on_error=args.on_error)
        stats = tokenize_paths(args.input, args.output, tok, opts, progress_bar=not args.quiet)
    except InternLMCoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted; the file in progress was not finalized (its temporary files are removed)",
              file=sys.stderr)
        return 130
    mb = stats.bytes_in / 1e6
    secs = max(stats.seconds, 1e-9)
    print(f"tokenized {stats.files} file(s): {stats.docs} documents, {stats.tokens} tokens, {mb:.2f} MB in "
          f"{stats.seconds:.2f} s ({mb / secs:.2f} MB/s, {stats.tokens / secs / 1e3:.0f}k tokens/s)")
    print(f"tokenizer {tok.name} (vocab {tok.vocab_size}), format {args.fmt} ({describe_dtype(args.fmt, tok.vocab_size)}), "
          f"bos {'on' if args.add_bos else 'off'}, eos {'on' if args.add_eos else 'off'}, "
          f"documents from {'InternLM-compatible raw records' if compat else repr(args.text_key) + ' fields / lines'}")
    if stats.skipped:
        detail = ", ".join(f"{k}: {n}" for k, n in sorted(stats.skipped.items()))
        print(f"skipped {sum(stats.skipped.values())} ({detail})")
    if stats.empty_texts:
        print(f"skipped {stats.empty_texts} records with empty text")
    for src, dst, docs, toks in stats.outputs[:20]:
        index = os.path.basename(dst[:-4] + ".idx") if args.fmt == "megatron" else ".meta"
        print(f"  {src} -> {dst} (+ {index}): {docs} documents, {toks} tokens")
    if len(stats.outputs) > 20:
        print(f"  ... and {len(stats.outputs) - 20} more files")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `... | head`: the reader is gone, nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
