"""``python -m internlm_core.data.verify PATH...``: check tokenized files of any size (every format).

Ours: the whole index and the checksum of the token data; InternLM's: the index and every line; Megatron's: the
whole index against the size of its `.bin`. Prints one line per file; exits 1 when any file is broken.
"""

from __future__ import annotations

import argparse
import sys

from internlm_core.errors import DataError

from .dataset import find_bin_files
from .formats import verify_token_file


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Verify .bin files with their index (.bin.meta or Megatron's .idx).")
    p.add_argument("paths", nargs="+", help=".bin files or folders of them")
    args = p.parse_args(argv)
    bad = 0
    for root in args.paths:
        try:
            files = find_bin_files(root)
            if not files:
                raise DataError(f"{root}: no .bin files found")
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            bad += 1
            continue
        for path in files:
            try:
                f = verify_token_file(path)
                print(f"ok  {path}: {f.format}, {f.num_docs} documents, {f.num_tokens} tokens")
            except DataError as e:
                print(f"error: {e}", file=sys.stderr)
                bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
