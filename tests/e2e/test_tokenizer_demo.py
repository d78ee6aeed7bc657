"""The demo corpus: made from Python's standard library, tokenized by tools/tokenizer.py, read by the loaders."""

import json
import subprocess
import sys
from pathlib import Path

from internlm_core.config.schema import DataConfig
from internlm_core.data import build_train_loader, build_valid_loaders

ROOT = Path(__file__).resolve().parents[2]


def _run(tool, *args):
    p = subprocess.run([sys.executable, str(ROOT / "tools" / tool), *map(str, args)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_demo_corpus_end_to_end(tmp_path):
    out = _run("make_demo_corpus.py", "--output", tmp_path / "raw", "--max-code-mb", "0.5", "--valid-max-kb", "0")
    assert "train code" in out and "valid docs" in out
    rec = json.loads((tmp_path / "raw" / "train" / "docs" / "stdlib.jsonl").read_text(encoding="utf-8").splitlines()[0])
    assert set(rec) == {"text", "source"} and len(rec["text"]) >= 40
    def sources(split, kind):
        with (tmp_path / "raw" / split / kind / "stdlib.jsonl").open(encoding="utf-8") as fh:
            return [json.loads(line)["source"] for line in fh]

    # a module's docstrings are in the split of its source code
    split_of = {}
    for split in ("train", "valid"):
        for rel in sources(split, "code"):
            split_of[rel[:-3].replace("/", ".").removesuffix(".__init__")] = split
    for split in ("train", "valid"):
        for name in sources(split, "docs"):
            module = max((m for m in split_of if name == m or name.startswith(m + ".")), key=len)
            assert split_of[module] == split, (name, module)
    assert "valid" in split_of.values()
    for split in ("train", "valid"):
        _run("tokenizer.py", "--quiet", "--input", tmp_path / "raw" / split, "--output", tmp_path / "bin" / split)
    cfg = DataConfig(seq_len=128, micro_bsz=2, packed_length=256, micro_num=2, valid_micro_num=2, seed=1,
                     train_folder=str(tmp_path / "bin" / "train"), valid_folder=str(tmp_path / "bin" / "valid"))
    ld = build_train_loader(cfg, dp_rank=0, dp_size=1, vocab_size=259)
    assert set(ld.type_names.values()) == {"code", "docs"}
    b = next(iter(ld))
    assert b["input_ids"].max() < 259
    valid = build_valid_loaders(cfg, dp_rank=0, dp_size=1, vocab_size=259)
    assert set(valid) == {"code", "docs"}
    assert sum(1 for _ in valid["docs"]) == len(valid["docs"]) >= 1


def test_demo_corpus_refuses_a_validation_set_too_small_to_mean_anything(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "make_demo_corpus.py"), "--output", str(tmp_path),
                        "--max-code-mb", "0.2", "--valid-percent", "0"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 1
    assert p.stderr.strip() == ("error: validation text of kind 'code': 0 bytes, expected at least 2000 "
                                "(--valid-min-kb); raise --valid-percent")
