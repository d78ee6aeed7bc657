"""Checkpoints on torch.distributed.checkpoint: sharded async save, exact resume, resharding, object storage.

By job: manager.py (CheckpointManager, orchestration), registry.py (what is saved), meta.py (meta.json and the
marker), writer.py (one save: write, upload, marker), retention.py (keep_last_k, snapshot slots), restore.py
(loading, other formats), catalog.py (which checkpoints exist, what a path names), storage.py / s3.py (where they
live), collectives.py (the checkpoint's process group), safe_dcp.py / staging.py (DCP plumbing), integrity.py
(checksums: nothing corrupt is loaded), lease.py (one live writer per folder), checkpointer.py (the loop's save
rule), rewind.py (automatic rewind on loss spikes); other formats through the model families' StateDictAdapters:
foreign.py (what they share), hf.py (Hugging Face folders, with safetensors_io.py and tokenizer_export.py),
internlm_format.py (InternLM's / InternEvo's checkpoint folders).
"""

from .checkpointer import Checkpointer, SaveDecision
from .catalog import CheckpointRef, find_complete_checkpoints, latest_checkpoint, parse_destination
from .integrity import CorruptCheckpoint, file_crc32
from .lease import Lease
from .manager import CheckpointManager
from .meta import RESUME_NOTES
from .registry import CONTENTS, normalize_content
from .restore import FOREIGN_LOADERS, LoadResult
from .rewind import RewindOutcome, SpikeRewinder, build_spike_rewind
from .rng import RNGState
from .s3 import S3Storage
from .safe_dcp import read_dcp_metadata
from .storage import LEASE, MARKER, META, REJECTED, SNAPSHOT_SLOTS, LocalStorage, Storage
from .writer import SaveResult

__all__ = ["CONTENTS", "FOREIGN_LOADERS", "LEASE", "MARKER", "META", "REJECTED", "RESUME_NOTES", "SNAPSHOT_SLOTS",
           "CheckpointManager", "CheckpointRef", "Checkpointer", "CorruptCheckpoint", "Lease", "LoadResult",
           "LocalStorage", "RNGState", "RewindOutcome", "S3Storage", "SaveDecision", "SaveResult", "SpikeRewinder",
           "Storage", "build_spike_rewind",
           "file_crc32", "find_complete_checkpoints", "latest_checkpoint", "normalize_content", "parse_destination",
           "read_dcp_metadata"]
