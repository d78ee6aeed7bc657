"""Monitoring and fault handling: alerts, the exception monitor, hang watchdog, loss health, stragglers, stop
requests, the memory report and the torch profiler."""

from .alert import AlertManager, FeishuSink, FileSink, WebhookSink, build_alert_manager, job_key
from .exception_monitor import ExceptionMonitor, abort_process_group, monitored
from .loss_health import LossHealthMonitor, build_loss_health
from .memory_report import MemoryProfiler
from .profiler import TorchProfiler, build_profiler
from .restart import RestartReporter
from .stop import StopController, StopDecision, build_stop_controller
from .straggler import (StragglerMonitor, StragglerReport, build_straggler_monitor, device_benchmark,
                        diagnose_stragglers)
from .watchdog import HANG_EXIT_CODE, HangWatchdog, build_watchdog, format_all_stacks

__all__ = [
    "AlertManager", "FeishuSink", "FileSink", "WebhookSink", "build_alert_manager", "job_key",
    "ExceptionMonitor", "abort_process_group", "monitored",
    "LossHealthMonitor", "build_loss_health",
    "MemoryProfiler", "TorchProfiler", "build_profiler", "RestartReporter",
    "StopController", "StopDecision", "build_stop_controller",
    "StragglerMonitor", "StragglerReport", "build_straggler_monitor", "device_benchmark", "diagnose_stragglers",
    "HANG_EXIT_CODE", "HangWatchdog", "build_watchdog", "format_all_stacks",
]
