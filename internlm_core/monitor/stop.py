"""Stop requests: InternLM's stop file and SIGTERM / SIGUSR1, agreed on by all ranks at the same step.

    stop = build_stop_controller(cfg.ckpt, rank, alerts)    # installs the signal handlers

The trainer's loop polls it after each step (every rank: it is a collective when a process group exists; the
trainer samples the request (`sample`) within its step's one host read, agrees on it there with the step's
inf/nan flag and hands it back (`agree`), so its poll issues no collective and no read of its own; the request is
thus sampled at the optimizer step, before the step's `on_step_end` observers: a stop file written or a signal
received after that point is seen at the next step):

    decision = stop.poll(step)          # `step`: the step number checkpoints are named by, after the step
    if decision.save: ckpt.save(step)   # then
    if decision.stop: break             # save, leave the loop, exit 0 (SLURM may requeue the job)
    ...
    stop.close()                        # restores the previous signal handlers (the loop does it at the end)

Stop file (InternLM's `ckpt.stop_file_path`): it holds one integer N. N < 0: save a checkpoint at step
|N| and go on; N > 0: save at step N and stop; 0: nothing. The step must match exactly, as in InternLM
(a request for a step already passed is ignored, with a warning). At start rank 0 writes "0" into it
(creating its folder), so a request left over from an earlier run does not fire after a restart.

Reading: rank 0 alone reads the file, at most once per `poll` and only when its mtime or size changed
(one `os.stat` per step otherwise); the value reaches the other ranks through the same all_reduce that
agrees on signals. Letting every rank read a shared file could give different ranks different values
(NFS caching) and so different decisions.

Signals: SIGTERM (SLURM preemption, `scancel`, torchrun shutting down) and SIGUSR1 (`sbatch
--signal=USR1@90`, sent ahead of the time limit) only set a flag; the next `poll` turns it into
save + stop. Agreement: one `all_reduce(MAX)` per poll over [stop-file value (rank 0; a very negative
sentinel elsewhere), signal number or 0], so if any rank got a signal, every rank stops at that step.
A rank blocked inside a collective cannot run Python signal handlers until the collective returns; a
launcher's SIGKILL after its grace period (SLURM KillWait, torchrun's 30 s) still ends it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
import torch.distributed as dist

from internlm_core.utils import collectives
from internlm_core.utils.logging import get_logger

from .alert import AlertManager

if TYPE_CHECKING:
    from internlm_core.config.schema import CkptConfig

logger = get_logger(__name__)

_NO_VALUE = -(2**62)  # what ranks other than 0 put in the stop-file slot of the MAX all-reduce
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@dataclass(frozen=True)
class StopDecision:
    """What the loop does after this step: save a checkpoint, stop (after saving), and why."""

    save: bool = False
    stop: bool = False
    reason: str = ""

    def asked(self, save: bool, stop: bool, reason: str) -> "StopDecision":
        """This decision with what else was asked of the step (a callback's `view.requests`): a stop saves too."""
        if not (save or stop):
            return self
        return StopDecision(save=True, stop=self.stop or stop, reason=self.reason or reason)


class StopController:
    """Turns the stop file and signals into one `StopDecision` per step, the same on all ranks.

    Args:
        stop_file_path: InternLM's stop file (None: signals only).
        rank: global rank; rank 0 reads (and at start resets) the stop file and sends notices.
        alerts: an info alert when a stop/save request or a signal is seen (rank 0 / the signalled rank).
        signals: signals that request save + stop (their handlers are installed now, if this is the main thread).
        group: process group to agree over (None: the default group, if initialized).
        reset_file: write "0" into the stop file at start (rank 0), as InternLM does.
    """

    def __init__(self, stop_file_path: str | Path | None = None, rank: int = 0,
                 alerts: Optional[AlertManager] = None, signals: Sequence[int] = DEFAULT_SIGNALS,
                 group: Optional[dist.ProcessGroup] = None, reset_file: bool = True):
        self.stop_file_path = Path(stop_file_path) if stop_file_path else None
        self.rank = rank
        self.alerts = alerts
        self.group = group
        self.signal_received: Optional[int] = None  # set by the handler; read by poll
        self._previous: dict[int, Any] = {}
        self._file_stat: Optional[tuple[int, int]] = None
        self._file_value = 0
        self._announced: Optional[int] = None
        self._signal_announced = False
        self._agreed: Optional[tuple[int, int, int]] = None  # `agree`: what the next poll decides from
        if self.stop_file_path is not None and rank == 0 and reset_file:
            self.stop_file_path.parent.mkdir(parents=True, exist_ok=True)
            self.stop_file_path.write_text("0", encoding="utf-8")
        self.install_signal_handlers(signals)

    # -- signals ---------------------------------------------------------------------------------------
    def install_signal_handlers(self, signals: Sequence[int]) -> None:
        if not signals:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning("stop requests: not on the main thread; signal handlers not installed")
            return
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        # Only set a flag: a handler runs between bytecodes of the main thread, anywhere in the loop.
        self.signal_received = signum

    def close(self) -> None:
        """Restore the signal handlers that were there before."""
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    # -- stop file -------------------------------------------------------------------------------------
    def _read_file(self) -> int:
        path = self.stop_file_path
        if path is None:
            return 0
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._file_stat, self._file_value = None, 0
            return 0
        key = (st.st_mtime_ns, st.st_size)
        # Two writes within one timestamp tick can leave mtime and size alike: re-read a file changed just now.
        recent = time.time_ns() - st.st_mtime_ns < 2_000_000_000
        if key != self._file_stat or recent:
            self._file_stat = key
            text = path.read_text(encoding="utf-8", errors="replace").strip()
            try:
                self._file_value = int(text) if text else 0
            except ValueError:
                logger.warning("stop file %s: expected an integer, got %r; ignored", path, text[:40])
                self._file_value = 0
        return self._file_value

    # -- the decision ----------------------------------------------------------------------------------
    def sample(self) -> tuple[int, int]:
        """This rank's part of a stop request: (the stop file's value on rank 0, a placeholder elsewhere; the signal
        received, 0 if none). A caller that agrees on it itself (the trainer, within its step's one host read,
        trainer/readout.py) maxes it over the group and hands the result to `agree` for the next `poll`."""
        return (self._read_file() if self.rank == 0 else _NO_VALUE), self.signal_received or 0

    def agree(self, local_signal: int, file_value: int, sig: int) -> None:
        """What the next `poll` decides from, instead of sampling and agreeing itself: this rank's sampled signal,
        the file value and the signal maxed over the group (`sample`)."""
        self._agreed = (local_signal, file_value, sig)

    def poll(self, step: int) -> StopDecision:
        """The decision after `step`; a collective (every rank calls it at every step) when a group exists, unless
        the caller agreed on the request already (`agree`)."""
        agreed, self._agreed = self._agreed, None
        if agreed is not None:
            local_signal, file_value, sig = agreed
        else:
            file_value, local_signal = self.sample()
            sig = local_signal
            if collectives.dist_ready():
                t = torch.tensor([file_value, local_signal], dtype=torch.int64,
                                 device=collectives.group_device(self.group))
                collectives.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
                file_value, sig = (int(v) for v in t.tolist())
        if file_value == _NO_VALUE:
            file_value = 0

        if sig:
            name = signal.Signals(sig).name
            reason = f"{name} received" if local_signal == sig else f"{name} received by another rank"
            if not self._signal_announced:
                self._signal_announced = True
                logger.warning("stop request: %s; saving a checkpoint at step %d and stopping", reason, step)
                if self.alerts is not None and (self.rank == 0 or local_signal):
                    self.alerts.send(f"{name}: stopping at step {step}",
                                     f"{reason} (rank {self.rank}); saving a checkpoint at step {step} and "
                                     "exiting so the job can be requeued", level="warning")
            return StopDecision(save=True, stop=True, reason=reason)

        if file_value == 0:
            return StopDecision()
        target, quit_ = abs(file_value), file_value > 0
        what = "save and stop" if quit_ else "save"
        if self._announced != file_value and self.rank == 0:
            self._announced = file_value
            if target < step:
                logger.warning("stop file %s asks to %s at step %d, which has passed (now step %d); ignored",
                               self.stop_file_path, what, target, step)
            else:
                logger.info("stop file %s: will %s at step %d (now step %d)", self.stop_file_path, what, target, step)
                if self.alerts is not None:
                    self.alerts.send(f"training will {what} at step {target}",
                                     f"stop file requests: {what} at step {target}; now at step {step}", level="info")
        if target != step:
            return StopDecision()
        return StopDecision(save=True, stop=quit_, reason=f"stop file {self.stop_file_path}: {file_value}")


def build_stop_controller(ckpt_cfg: CkptConfig, rank: int = 0, alerts: Optional[AlertManager] = None,
                          **kwargs: Any) -> StopController:
    """A StopController from `cfg.ckpt.stop_file_path`, handling SIGTERM and SIGUSR1."""
    return StopController(ckpt_cfg.stop_file_path, rank=rank, alerts=alerts, **kwargs)
