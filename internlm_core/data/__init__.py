"""Data: on-disk token formats, tokenizers, packing with cu_seqlens, stateful samplers, train/valid/dummy loaders.

The trainer's interface::

    from internlm_core.data import build_train_loader, build_valid_loaders, Batch
    loader = build_train_loader(data_cfg, dp_rank=r, dp_size=n, vocab_size=v)   # infinite, stateful
    valid = build_valid_loaders(data_cfg, dp_rank=r, dp_size=n, vocab_size=v)   # {name: finite loader}

The torch-dependent names (the loaders) are imported lazily, so that tools/tokenizer.py starts without torch.
"""

from .dataset import Corpus, DummySource, build_train_corpus, build_valid_corpora, find_bin_files
from .formats import TokenFile, open_token_file
from .packing import IGNORE_INDEX, Packer, StreamOrder

_LAZY = {"Batch", "TrainLoader", "ValidLoader", "build_train_loader", "build_valid_loaders", "collate"}

__all__ = sorted(_LAZY) + [
    "Corpus", "DummySource", "build_train_corpus", "build_valid_corpora", "find_bin_files",
    "TokenFile", "open_token_file", "IGNORE_INDEX", "Packer", "StreamOrder",
]


def __getattr__(name):
    if name in _LAZY:
        from . import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
