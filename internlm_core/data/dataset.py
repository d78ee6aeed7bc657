"""Datasets: the `.bin` files of a folder (with dataset type ids), or InternLM-style random dummy data.

A `DocTable` is the documents of several sources (token files or the dummy source) one after the other: global
document g is document ``g - starts[s]`` of source s. It holds no per-document array of its own: the effective
length of each document (0 for one shorter than `min_length`, which packing skips) comes from `lengths`, an array
on disk read by pread (the training index cache, see index.py) or in memory (validation and dummy data, small).

Dataset type ids (`data.dataset_type_mode`):
- ``"subfolder"`` (default, InternEvo's rule): the type of a file is the name of the top-level entry of
  `train_folder` it lies under (``train_folder/<name>/.../x.bin`` → ``<name>``; a file directly in the folder is its
  own entry, named by its file name without ``.bin``). Ids are given in sorted name order. This is the default
  because it works for any folder layout and names the per-type metrics after the user's own folders; InternLM's
  fixed mapping fails on any folder not named ``en``/``cn``/``code``.
- ``"internlm"`` (InternLM's rule): exactly one folder of a file's path must match ``[z_]*en``, ``[z_]*cn`` or
  ``[z_]*code``, giving ids 0, 1, 2: below `train_folder` first, else anywhere in the whole path (InternLM matches
  the whole path, so `train_folder=/data/en` is type en). Validation sets are then named as InternLM names them:
  one per folder holding `.bin` files, by that folder's own name.
"""

from __future__ import annotations

import bisect
import os
import re
from typing import Optional, Sequence, Union

import numpy as np

from internlm_core.errors import DataError
from internlm_core.utils.logging import get_logger

from .formats import open_token_file
from .tokenfile import VERIFY_MAX_BYTES, FileArray, TokenFile

logger = get_logger(__name__)

INTERNLM_TYPE_IDS = {"en": 0, "cn": 1, "code": 2}
CACHE_DIR_NAME = ".index_cache"  # the default index cache inside a training folder (see index.py)


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
        dirs[:] = [d for d in dirs if d != CACHE_DIR_NAME]  # our index cache is no data
        out.extend(os.path.join(root, f) for f in sorted(files) if f.endswith(".bin"))
    return out


_EXTS = (".bin", ".jsonl.gz", ".jsonl", ".txt.gz", ".txt", ".parquet")  # stripped from a file's type name


def _top_entry(folder: str, path: str) -> str:
    rel = os.path.relpath(path, folder)
    first = rel.split(os.sep)[0]
    if first == rel:
        for ext in _EXTS:
            if first.endswith(ext):
                return first[: -len(ext)]
    return first


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
            if len(hits) != 1:  # InternLM matches the whole path: train_folder may itself be .../en
                whole = os.path.abspath(p).replace(os.sep, "/")
                hits = [i for k, i in INTERNLM_TYPE_IDS.items() if re.search(rf"/[z_]*{k}/", whole)]
            if len(hits) != 1:
                raise DataError(f"{p}: dataset_type_mode='internlm' needs exactly one folder named en, cn or code "
                                f"(optionally prefixed by z/_) in its path; found {len(hits)}")
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

    def read_lengths(self, start: int, stop: int) -> np.ndarray:
        return self.lengths[start:stop]

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


class DocTable:
    """Documents of `sources` one after the other, with the type id of each source and effective lengths.

    `lengths[g]`: tokens of document g, 0 when it is shorter than `min_length` (it is skipped); a `FileArray` or a
    numpy array. `source_tokens[s]`: effective tokens of source s; `tokens_per_type`: {type id: effective tokens}.
    """

    def __init__(self, sources: list, source_types: Sequence[int], type_names: dict,
                 lengths: Union[FileArray, np.ndarray], source_tokens: Sequence[int], min_length: int = 0):
        self.sources = list(sources)
        self.source_types = np.asarray(source_types, dtype=np.int64)
        self.type_names = dict(type_names)
        counts = [int(s.num_docs) for s in self.sources]
        self.starts = [0]
        for c in counts:
            self.starts.append(self.starts[-1] + c)
        self._starts = np.asarray(self.starts, dtype=np.int64)
        self.lengths = lengths
        self.keep_min = max(1, int(min_length))
        self.num_docs = self.starts[-1]
        self.source_tokens = [int(x) for x in source_tokens]
        self.num_tokens = sum(self.source_tokens)
        self.tokens_per_type: dict[int, int] = {}
        for t, n in zip(self.source_types.tolist(), self.source_tokens):
            self.tokens_per_type[t] = self.tokens_per_type.get(t, 0) + n

    def locate(self, g: int) -> tuple[int, int]:
        s = bisect.bisect_right(self.starts, g) - 1
        return s, g - self.starts[s]

    def length(self, g: int) -> int:
        if isinstance(self.lengths, np.ndarray):
            return int(self.lengths[g])
        s = bisect.bisect_right(self.starts, g) - 1  # the source's own index: its entry is read with the tokens
        n = self.sources[s].length(g - self.starts[s])
        return n if n >= self.keep_min else 0

    def lengths_range(self, g0: int, g1: int) -> np.ndarray:
        if isinstance(self.lengths, FileArray):
            return self.lengths.read(g0, g1).astype(np.int64)
        return np.asarray(self.lengths[g0:g1], dtype=np.int64)

    def type_of(self, g: int) -> int:
        return int(self.source_types[bisect.bisect_right(self.starts, g) - 1])

    def types_of(self, gs: np.ndarray) -> np.ndarray:
        return self.source_types[np.searchsorted(self._starts, gs, side="right") - 1]

    def read_into(self, out: np.ndarray, g: int, start: int, stop: int) -> None:
        s, i = self.locate(g)
        self.sources[s].read_into(out, i, start, stop)

    def location(self, g: int) -> str:
        s, i = self.locate(g)
        return self.sources[s].doc_location(i)

    def source_range(self, s: int) -> tuple[int, int]:
        return self.starts[s], self.starts[s + 1]

    @classmethod
    def in_memory(cls, sources: list, source_types: Sequence[int], type_names: dict, min_length: int = 0,
                  what: str = "data") -> "DocTable":
        """A table whose lengths are read into memory now (validation and dummy data: small)."""
        keep_min = max(1, int(min_length))
        parts = []
        for source, t in zip(sources, source_types):
            lens = np.asarray(source.read_lengths(0, source.num_docs), dtype=np.int64)
            eff = np.where(lens >= keep_min, lens, 0)
            dropped = int(np.count_nonzero(eff == 0))
            if dropped:
                logger.info("%s: dropped %d of %d documents shorter than %d tokens", source.path, dropped,
                            source.num_docs, keep_min)
            parts.append(eff)
        lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        table = cls(sources, source_types, type_names, lengths, [int(p.sum()) for p in parts], min_length)
        if table.num_tokens == 0:
            raise DataError(no_documents_message(what, sources, min_length))
        return table


def no_documents_message(what: str, sources: Sequence, min_length: int) -> str:
    where = ", ".join(s.path for s in sources[:3]) + (" ..." if len(sources) > 3 else "")
    return f"{what}: no documents left (min_length={min_length}) in {where}"


def open_files(files: Sequence[str], verify: Optional[bool] = None) -> list[TokenFile]:
    """Open token files (headers and index ends only unless `verify`; see formats.open_token_file)."""
    return [open_token_file(p, verify=verify) for p in files]


def list_folder(folder: str, mode: str, what: str) -> tuple[list[str], list[int], dict[int, str]]:
    """(the .bin files under `folder`, the type id of each, {type id: name})."""
    files = find_bin_files(folder)
    if not files:
        raise DataError(f"{what} {folder}: no .bin files found (tokenize text with tools/tokenizer.py first)")
    names, per_file = type_names_for(folder, files, mode)
    return files, per_file, names


def build_valid_tables(data_cfg) -> dict[str, DocTable]:
    """One table per subfolder of `valid_folder` ("val" for files directly in it), in sorted name order."""
    folder = data_cfg.valid_folder
    if folder is None:
        return {}
    files = find_bin_files(folder)
    if not files:
        raise DataError(f"data.valid_folder {folder}: no .bin files found")
    groups: dict[str, list[str]] = {}
    for p in files:
        rel = os.path.relpath(p, folder)
        if data_cfg.dataset_type_mode == "internlm":  # InternLM: each folder holding .bin files, by its own name
            name = os.path.basename(os.path.dirname(os.path.abspath(p)))
        else:
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
            try:
                names, per_file = type_names_for(folder, groups[name], "internlm")
            except DataError:  # a validation folder outside en/cn/code is its own type
                names, per_file = {len(INTERNLM_TYPE_IDS): name}, [len(INTERNLM_TYPE_IDS)] * len(groups[name])
        else:
            tid = train_names.get(name)
            if tid is None:
                tid, next_id = next_id, next_id + 1
            names, per_file = {tid: name}, [tid] * len(groups[name])
        total = sum(os.path.getsize(p) for p in groups[name])
        sources = open_files(groups[name], verify=total <= VERIFY_MAX_BYTES)
        # every validation document counts, short ones too (InternLM validates with min_length=0)
        out[name] = DocTable.in_memory(sources, per_file, names, 0, f"data.valid_folder {os.path.join(folder, name)}")
    return out


def dummy_table(data_cfg, vocab_size: int, seed_offset: int = 0, num_samples: Optional[int] = None) -> DocTable:
    """InternLM's random dataset as a table of one source with type "dummy"."""
    src = DummySource(num_samples or data_cfg.dummy_num_samples, data_cfg.seq_len, vocab_size,
                      data_seed(data_cfg) + seed_offset, data_cfg.fixed_random_dataset_seqlen,
                      data_cfg.dummy_distribution)
    return DocTable.in_memory([src], [0], {0: "dummy"}, data_cfg.min_length,
                              "dummy validation data" if seed_offset else "dummy data")


def data_seed(data_cfg) -> int:
    return int(data_cfg.seed if data_cfg.seed is not None else 1024)
