"""The one exception family of internlm-core.

Messages name the culprit (config key, file and line, rank) and what was expected, so that
`train.py` and `tools/*.py` can print them as they are and exit non-zero without a traceback.
"""


class InternLMCoreError(Exception):
    """Base of every error a user can act on (bad config, bad data, bad checkpoint, bad launch)."""


class ConfigError(InternLMCoreError):
    """A config file, key or value is wrong."""


class DataError(InternLMCoreError):
    """A data file (text, .bin, .bin.meta) is missing, malformed or inconsistent."""


class CheckpointError(InternLMCoreError):
    """A checkpoint cannot be saved, found or loaded."""


class LaunchError(InternLMCoreError):
    """The process group cannot be formed from the launcher environment."""


class TrainingError(InternLMCoreError):
    """Training cannot continue (for example too many consecutive inf/nan steps)."""
