"""Checkpoints on torch.distributed.checkpoint: sharded async save, exact resume, resharding, object storage.

See `manager.py` (CheckpointManager) and `storage.py` (folder layout, local and s3:// destinations).
"""

from .callback import CheckpointCallback
from .manager import (CONTENTS, RESUME_NOTES, CheckpointManager, CheckpointRef, LoadResult, SaveResult,
                      find_complete_checkpoints, latest_checkpoint, normalize_content, register_model_loader)
from .rng import RNGState
from .safe_dcp import read_dcp_metadata
from .storage import MARKER, META, SNAPSHOT_SLOTS, Destination, LocalDestination, S3Destination, parse_destination

__all__ = ["CONTENTS", "MARKER", "META", "RESUME_NOTES", "SNAPSHOT_SLOTS", "CheckpointCallback", "CheckpointManager",
           "CheckpointRef", "Destination", "LoadResult", "LocalDestination", "RNGState", "S3Destination",
           "SaveResult", "find_complete_checkpoints", "latest_checkpoint", "normalize_content", "parse_destination",
           "read_dcp_metadata", "register_model_loader"]
