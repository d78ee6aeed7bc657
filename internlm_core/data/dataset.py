"""Datasets: the `.bin` files of a folder (with dataset type ids), or InternLM-style random dummy data.

A `Corpus` is a flat list of documents drawn from several sources (token files or the dummy source), after
`min_length` filtering: `lengths[k]` and `read_into(out, k, start, stop)` for the k-th kept document, and the
type id of each document.

Dataset type ids (`data.dataset_type_mode`):
- ``"subfolder"`` (default, InternEvo's rule): the type of a file is the name of the top-level entry of
  `train_folder` it lies under (``train_folder/<name>/.../x.bin`` → ``<name>``; a file directly in the folder is its
  own entry, named by its file name without ``.bin``). Ids are given in sorted name order. This is the default
  because it works for any folder layout and names the per-type metrics after the user's own folders; InternLM's
  fixed mapping fails on any folder not named ``en``/``cn``/``code``.
- ``"internlm"`` (InternLM's rule): exactly one component of the path below `train_folder` must match
  ``[z_]*en``, ``[z_]*cn`` or ``[z_]*code``, giving ids 0, 1, 2.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from internlm_core.errors import DataError
from internlm_core.utils.logging import get_logger

from .formats import VERIFY_MAX_BYTES, TokenFile, open_token_file

logger = get_logger(__name__)

INTERNLM_TYPE_IDS = {"en": 0, "cn": 1, "code": 2}


def find_bin_files(folder: str) -> list[str]:
    """Every `.bin` under `folder`, walked in sorted order, following symbolic links (each real folder once)."""
    folder = str(folder)
    if not os.path.exists(folder):
        raise DataError(f"{folder}: no such folder")
    if os.path.isfile(folder):
        if folder.endswith(".bin"):
            return [folder]
        raise DataError(f"{folder}: expected a folder of .bin files (or one .bin file)")
    out: list[str] = []
    seen: set[str] = set()
    for root, dirs, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:  # a link cycle, or the same folder linked twice
            dirs[:] = []
            continue
        seen.add(real)
        dirs.sort()
        out.extend(os.path.join(root, f) for f in sorted(files) if f.endswith(".bin"))
    return out


def _top_entry(folder: str, path: str) -> str:
    rel = os.path.relpath(path, folder)
    first = rel.split(os.sep)[0]
    return first[: -len(".bin")] if first == rel else first


def type_names_for(folder: str, files: Sequence[str], mode: str) -> tuple[dict[int, str], list[int]]:
    """({type id: name}, type id of each file) by `mode` ("subfolder" or "internlm")."""
    if mode == "subfolder":
        names = sorted({_top_entry(folder, p) for p in files})
        ids = {n: i for i, n in enumerate(names)}
        return {i: n for n, i in ids.items()}, [ids[_top_entry(folder, p)] for p in files]
    if mode == "internlm":
        per_file = []
        for p in files:
            rel = "/" + os.path.relpath(p, folder).replace(os.sep, "/")
            hits = [i for k, i in INTERNLM_TYPE_IDS.items() if re.search(rf"/[z_]*{k}/", rel)]
            if len(hits) != 1:
                raise DataError(f"{p}: dataset_type_mode='internlm' needs exactly one folder named en, cn or code "
                                f"(optionally prefixed by z/_) in its path below {folder}; found {len(hits)}")
            per_file.append(hits[0])
        return {i: k for k, i in INTERNLM_TYPE_IDS.items()}, per_file
    raise DataError(f"data.dataset_type_mode: expected 'subfolder' or 'internlm', got {mode!r}")


class DummySource:
    """InternLM's RandomDataset idea: `num_samples` random documents, deterministic from `seed`.

    Lengths are `seq_len` (fixed) or uniform in [1, seq_len]; ids are uniform in [0, vocab_size) or i.i.d. Zipf
    with s=1.1 over the ids (id = frequency rank, p(id) ∝ 1/(id+1)^1.1, truncated to the vocabulary). Document i
    is generated from its own seed (seed, i), so any document can be read in any order.
    """

    format = "dummy"

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int, fixed_length: bool = True,
                 distribution: str = "uniform"):
        if num_samples < 1:
            raise DataError(f"data.dummy_num_samples: expected >= 1, got {num_samples}")
        if distribution not in ("uniform", "zipf"):
            raise DataError(f"data.dummy_distribution: expected 'uniform' or 'zipf', got {distribution!r}")
        self.path = f"<dummy data, seed {seed}>"
        self.vocab_size = vocab_size
        self.seed = int(seed)
        self.distribution = distribution
        if fixed_length:
            self.lengths = np.full(num_samples, seq_len, dtype=np.int64)
        else:
            rng = np.random.Generator(np.random.PCG64([self.seed, 0x4C454E]))
            self.lengths = rng.integers(1, seq_len + 1, size=num_samples, dtype=np.int64)
        self._cdf = None
        if distribution == "zipf":
            p = 1.0 / np.power(np.arange(1, vocab_size + 1, dtype=np.float64), 1.1)
            self._cdf = np.cumsum(p)
            self._cdf /= self._cdf[-1]
        self._cache_i, self._cache = -1, None

    @property
    def num_docs(self) -> int:
        return len(self.lengths)

    def doc_location(self, i: int) -> str:
        return f"{self.path}: document {i}"

    def _doc(self, i: int) -> np.ndarray:
        if i != self._cache_i:
            rng = np.random.Generator(np.random.PCG64([self.seed, int(i)]))
            n = int(self.lengths[i])
            if self._cdf is None:
                doc = rng.integers(0, self.vocab_size, size=n, dtype=np.int64)
            else:
                doc = np.searchsorted(self._cdf, rng.random(n), side="right").astype(np.int64)
                np.minimum(doc, self.vocab_size - 1, out=doc)
            self._cache_i, self._cache = i, doc
        return self._cache

    def read(self, i: int, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        return self._doc(i)[start:stop]

    def read_into(self, out: np.ndarray, i: int, start: int, stop: int) -> None:
        out[:] = self._doc(i)[start:stop]


@dataclass
class Corpus:
    """The kept documents of some sources, in source order.

    `sources[src[k]]` holds document k as its document `doc[k]`; `lengths[k]` tokens; type id `types[k]`.
    """

    sources: list
    src: np.ndarray       # int32, source index of each kept document
    doc: np.ndarray       # int64, document index inside its source
    lengths: np.ndarray   # int64
    types: np.ndarray     # int32, type id of each kept document
    type_names: dict

    @property
    def num_docs(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def read_into(self, out: np.ndarray, k: int, start: int, stop: int) -> None:
        self.sources[self.src[k]].read_into(out, int(self.doc[k]), start, stop)

    def location(self, k: int) -> str:
        return self.sources[self.src[k]].doc_location(int(self.doc[k]))

    @classmethod
    def from_sources(cls, sources: list, source_types: Sequence[int], type_names: dict, min_length: int = 0,
                     what: str = "data") -> "Corpus":
        srcs, docs, lens, types = [], [], [], []
        keep_min = max(1, int(min_length))
        for s, (source, t) in enumerate(zip(sources, source_types)):
            keep = np.nonzero(source.lengths >= keep_min)[0]
            dropped = source.num_docs - len(keep)
            if dropped:
                logger.info("%s: dropped %d of %d documents shorter than %d tokens", source.path, dropped,
                            source.num_docs, keep_min)
            srcs.append(np.full(len(keep), s, dtype=np.int32))
            docs.append(keep.astype(np.int64))
            lens.append(source.lengths[keep].astype(np.int64))
            types.append(np.full(len(keep), t, dtype=np.int32))
        corpus = cls(sources, np.concatenate(srcs) if srcs else np.zeros(0, np.int32),
                     np.concatenate(docs) if docs else np.zeros(0, np.int64),
                     np.concatenate(lens) if lens else np.zeros(0, np.int64),
                     np.concatenate(types) if types else np.zeros(0, np.int32), dict(type_names))
        if corpus.num_tokens == 0:
            where = ", ".join(s.path for s in sources[:3]) + (" ..." if len(sources) > 3 else "")
            raise DataError(f"{what}: no documents left (min_length={min_length}) in {where}")
        return corpus


def open_files(files: Sequence[str], what: str) -> list[TokenFile]:
    """Open token files; checksums are verified when all of them together are small (see formats.VERIFY_MAX_BYTES)."""
    total = sum(os.path.getsize(p) for p in files)
    verify = total <= VERIFY_MAX_BYTES
    if not verify:
        logger.info("%s: %.1f GB of .bin files: checksums not verified at start-up "
                    "(python -m internlm_core.data.formats FOLDER verifies them)", what, total / 1e9)
    return [open_token_file(p, verify=verify) for p in files]


def open_folder(folder: str, mode: str, what: str) -> tuple[list[TokenFile], list[int], dict[int, str]]:
    files = find_bin_files(folder)
    if not files:
        raise DataError(f"{what} {folder}: no .bin files found (tokenize text with tools/tokenizer.py first)")
    names, per_file = type_names_for(folder, files, mode)
    sources = open_files(files, f"{what} {folder}")
    return sources, per_file, names


def build_train_corpus(data_cfg, vocab_size: int) -> Corpus:
    """The training documents: every .bin under `data_cfg.train_folder`, or the dummy dataset when it is None."""
    if data_cfg.train_folder is None:
        src = DummySource(data_cfg.dummy_num_samples, data_cfg.seq_len, vocab_size, _seed(data_cfg),
                          data_cfg.fixed_random_dataset_seqlen, data_cfg.dummy_distribution)
        return Corpus.from_sources([src], [0], {0: "dummy"}, data_cfg.min_length, "dummy data")
    sources, per_file, names = open_folder(data_cfg.train_folder, data_cfg.dataset_type_mode, "data.train_folder")
    corpus = Corpus.from_sources(sources, per_file, names, data_cfg.min_length, f"data.train_folder {data_cfg.train_folder}")
    logger.info("training data %s: %d files, %d documents, %d tokens, types %s", data_cfg.train_folder,
                len(sources), corpus.num_docs, corpus.num_tokens, names)
    return corpus


def build_valid_corpora(data_cfg) -> dict[str, Corpus]:
    """One corpus per subfolder of `valid_folder` ("val" for files directly in it), in sorted name order."""
    folder = data_cfg.valid_folder
    if folder is None:
        return {}
    files = find_bin_files(folder)
    if not files:
        raise DataError(f"data.valid_folder {folder}: no .bin files found")
    groups: dict[str, list[str]] = {}
    for p in files:
        rel = os.path.relpath(p, folder)
        name = rel.split(os.sep)[0] if os.sep in rel else "val"
        groups.setdefault(name, []).append(p)
    train_names: dict[str, int] = {}
    if data_cfg.train_folder is not None and data_cfg.dataset_type_mode == "subfolder":
        try:
            tn, _ = type_names_for(data_cfg.train_folder, find_bin_files(data_cfg.train_folder), "subfolder")
            train_names = {n: i for i, n in tn.items()}
        except DataError:
            train_names = {}
    out = {}
    next_id = max(train_names.values(), default=-1) + 1
    for name in sorted(groups):
        if data_cfg.dataset_type_mode == "internlm":
            names, per_file = type_names_for(folder, groups[name], "internlm")
        else:
            tid = train_names.get(name)
            if tid is None:
                tid, next_id = next_id, next_id + 1
            names, per_file = {tid: name}, [tid] * len(groups[name])
        sources = open_files(groups[name], f"data.valid_folder {os.path.join(folder, name)}")
        out[name] = Corpus.from_sources(sources, per_file, names, data_cfg.min_length,
                                        f"data.valid_folder {os.path.join(folder, name)}")
    return out


def _seed(data_cfg) -> int:
    return int(data_cfg.seed if data_cfg.seed is not None else 1024)
