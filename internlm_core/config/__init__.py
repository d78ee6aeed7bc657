"""Config: load a Python/YAML file in InternLM's format, apply overrides, validate into typed objects."""

from .loader import build_config, config_to_dict, dump_yaml, load_config
from .schema import Config

__all__ = ["Config", "build_config", "config_to_dict", "dump_yaml", "load_config"]
