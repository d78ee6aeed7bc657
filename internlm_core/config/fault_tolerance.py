"""The rules of `parallel.fault_tolerance` (replica groups over torchft), checked when a config is loaded."""

from __future__ import annotations

from ..errors import ConfigError
from .schema import FaultToleranceConfig, MonitorConfig

_KEY = "parallel.fault_tolerance"


def check_fault_tolerance(ft: FaultToleranceConfig, monitor: MonitorConfig) -> None:
    """ConfigError naming the key for a value that cannot describe replica groups, or for what replica groups
    cannot do (`monitor`: the spike rewind); nothing is checked while the section is off (its defaults describe
    one group)."""
    if not ft.enable:
        return
    if monitor.spike_rewind and ft.group_size > 1:
        raise ConfigError(f"monitor.spike_rewind: not with {_KEY} ({ft.group_size} replica groups): each group "
                          "judges the loss of its own share of the batch and would rewind alone, leaving the groups "
                          "with different weights that torchft goes on averaging gradients for; turn spike_rewind "
                          "off (loss spikes still alert) or train without replica groups")
    if ft.group_size < 1:
        raise ConfigError(f"{_KEY}.group_size: expected the number of replica groups (>= 1), got {ft.group_size}")
    if not 0 <= ft.replica_id < ft.group_size:
        raise ConfigError(f"{_KEY}.replica_id: expected 0 .. group_size - 1 = {ft.group_size - 1}, got {ft.replica_id}")
    if not 1 <= ft.min_replicas <= ft.group_size:
        raise ConfigError(f"{_KEY}.min_replicas: expected 1 .. group_size = {ft.group_size}, got {ft.min_replicas}")
    for key in ("timeout", "quorum_timeout"):
        if not getattr(ft, key) > 0:
            raise ConfigError(f"{_KEY}.{key}: expected seconds > 0, got {getattr(ft, key)}")
    if ft.max_retries < 0:
        raise ConfigError(f"{_KEY}.max_retries: expected an integer >= 0, got {ft.max_retries}")
    if ft.lighthouse is not None and not ft.lighthouse.startswith(("http://", "https://")):
        raise ConfigError(f"{_KEY}.lighthouse: expected the lighthouse's URL, e.g. http://host:29510, "
                          f"got {ft.lighthouse!r}")
