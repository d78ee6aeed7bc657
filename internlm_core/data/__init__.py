"""Data: on-disk token formats, tokenizers, the index cache, packing with cu_seqlens, mixtures, train/valid/dummy
and streaming loaders.

The trainer's interface::

    from internlm_core.data import build_train_loader, build_valid_loaders, Batch
    loader = build_train_loader(data_cfg, dp_rank=r, dp_size=n, vocab_size=v)   # infinite, stateful
    valid = build_valid_loaders(data_cfg, dp_rank=r, dp_size=n, vocab_size=v)   # {name: finite loader}
    loader.consumed_tokens_per_type()                                           # {type name: tokens}

The torch-dependent names (the loaders) are imported lazily, so that tools/tokenizer.py starts without torch.
"""

from .dataset import DocTable, DummySource, build_valid_tables, find_bin_files
from .formats import open_token_file
from .packing import IGNORE_INDEX, Packer, RowShape
from .tokenfile import TokenFile

_LAZY = {"Batch", "TrainLoader", "ValidLoader", "build_train_loader", "build_valid_loaders", "collate"}

__all__ = sorted(_LAZY) + [
    "DocTable", "DummySource", "build_valid_tables", "find_bin_files",
    "TokenFile", "open_token_file", "IGNORE_INDEX", "Packer", "RowShape",
]


def __getattr__(name):
    if name in _LAZY:
        from . import batches, loader

        return getattr(batches if name in ("Batch", "collate") else loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
