"""One live writer per checkpoint folder: a lease with a heartbeat.

The run that saves into `save_ckpt_folder` holds `LEASE` there (JSON: the holder's host, pid, process start time,
job ids, run folder, command line, and the time of its last heartbeat). Rank 0 takes it at start and renews it
every `lease_timeout / 4` seconds from a daemon thread; `close()` gives it back. Another run starting on the same
folder takes the lease over only when

* its heartbeat is older than `lease_timeout` (the holder died, its node was lost), or
* the holder ran on this host and its process is gone (pid not alive, or alive with another start time), or
* it is the same job started again: the same torchrun run id (`TORCHELASTIC_RUN_ID`: an elastic restart) or the
  same SLURM job id (a requeue); the launcher ends the old processes before it starts new ones;

otherwise it is refused with one line naming the holder. Taking and renewing are read, check, write, read back
(object stores have no exclusive create): of two runs racing for a free folder, the one whose write lands last
wins and the other is refused once it reads the lease back. Before every COMPLETE marker rank 0 checks that the
lease is still its own, so that a run that lost its lease never commits a checkpoint into the folder.
Heartbeats compare wall clocks of different hosts: keep them in sync (NTP), or `lease_timeout` well above their
skew.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from ..errors import CheckpointError
from ..utils.logging import get_logger
from ..utils.redact import redact_argv
from .storage import LEASE, Storage

logger = get_logger(__name__)


def process_start_time(pid: int) -> Optional[int]:
    """When process `pid` started (clock ticks since boot, from /proc), or None where that cannot be read."""
    try:
        stat = open(f"/proc/{pid}/stat", encoding="ascii", errors="replace").read()
    except OSError:
        return None
    try:
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def process_alive(pid: int, start: Optional[int]) -> bool:
    """Whether process `pid` of this host still runs (and is the one that started at `start`, when known)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = process_start_time(pid)
    return start is None or now is None or now == start


def job_ids(env: Optional[dict] = None) -> list[str]:
    """The ids a restarted or requeued job keeps: torchrun's run id, SLURM's job id."""
    env = os.environ if env is None else env
    ids = []
    if env.get("TORCHELASTIC_RUN_ID"):
        ids.append(f"torchelastic:{env['TORCHELASTIC_RUN_ID']}")
    if env.get("SLURM_JOB_ID"):
        ids.append(f"slurm:{env['SLURM_JOB_ID']}")
    return ids


@dataclass
class Holder:
    """Who holds a lease."""

    host: str
    pid: int
    start: Optional[int]
    jobs: list[str] = field(default_factory=list)
    run_dir: str = ""
    argv: str = ""
    since: str = ""
    heartbeat: float = 0.0

    @classmethod
    def me(cls, run_dir: str = "") -> "Holder":
        return cls(socket.gethostname(), os.getpid(), process_start_time(os.getpid()), job_ids(), str(run_dir),
                   " ".join(redact_argv(sys.argv))[:300], time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    @property
    def token(self) -> tuple:
        return self.host, self.pid, self.start

    def describe(self, now: float) -> str:
        parts = [f"pid {self.pid} on host {self.host}"]
        if self.jobs:
            parts.append("job " + ", ".join(self.jobs))
        if self.run_dir:
            parts.append(f"run folder {self.run_dir}")
        if self.since:
            parts.append(f"holding it since {self.since}")
        parts.append(f"last heartbeat {max(0.0, now - self.heartbeat):.0f} s ago")
        return ", ".join(parts)


def _parse(text: Optional[str]) -> Optional[Holder]:
    if text is None:
        return None
    try:
        d = json.loads(text)
        return Holder(str(d["host"]), int(d["pid"]), d.get("start"), list(d.get("jobs", [])), str(d.get("run_dir", "")),
                      str(d.get("argv", "")), str(d.get("since", "")), float(d["heartbeat"]))
    except (ValueError, KeyError, TypeError):
        logger.warning("lease: unreadable %s file (%r); treated as free", LEASE, text[:80])
        return None


class Lease:
    """The lease of one checkpoint folder, held (or refused) for this process (see the module docstring).

    Args:
        storage: the checkpoint folder.
        timeout_s: heartbeat age after which the lease is free (> 0).
        run_dir: this run's folder, named in a refusal.
        settle_s: pause between writing the lease and reading it back (lets a racing writer's write land first).
        clock: wall clock (tests).
    """

    def __init__(self, storage: Storage, timeout_s: float, run_dir: str = "", settle_s: float = 0.5,
                 clock: Callable[[], float] = time.time):
        if timeout_s <= 0:
            raise ValueError(f"lease timeout: expected > 0 seconds, got {timeout_s}")
        self.storage, self.timeout_s, self.settle_s, self.clock = storage, float(timeout_s), settle_s, clock
        self.me = Holder.me(run_dir)
        self.held = False
        self.lost: Optional[str] = None  # set by the heartbeat when another run took the lease
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def where(self) -> str:
        return f"ckpt.save_ckpt_folder {self.storage.url}"

    def read(self) -> Optional[Holder]:
        return _parse(self.storage.read_text("", LEASE))

    def _write(self) -> None:
        self.me.heartbeat = self.clock()
        self.storage.put_text("", LEASE, json.dumps(asdict(self.me), indent=1))

    def free_because(self, holder: Holder) -> Optional[str]:
        """Why `holder`'s lease may be taken over, or None when it may not."""
        age = self.clock() - holder.heartbeat
        if age > self.timeout_s:
            return f"its last heartbeat was {age:.0f} s ago (ckpt.lease_timeout {self.timeout_s:g} s)"
        if holder.host == self.me.host and not process_alive(holder.pid, holder.start):
            return f"its process {holder.pid} on this host is gone"
        same = sorted(set(holder.jobs) & set(self.me.jobs))
        if same:
            return f"it is this job started again ({', '.join(same)})"
        return None

    def _create(self) -> bool:
        """A free lease of a folder of this machine taken at once (a hard link is created atomically, or not at
        all); False when it cannot be done that way."""
        root = self.storage.local_path("")
        if root is None:
            return False
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f"{LEASE}.tmp{os.getpid()}"
        self.me.heartbeat = self.clock()
        tmp.write_text(json.dumps(asdict(self.me), indent=1), encoding="utf-8")
        try:
            os.link(tmp, root / LEASE)
            return True
        except OSError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def acquire(self) -> None:
        """Take the lease, or raise CheckpointError naming the run that holds it."""
        holder = self.read()
        if holder is None and self._create():
            self.held = True
            logger.info("lease of %s taken (heartbeat every %.0f s)", self.storage.url, self.interval_s)
            return
        holder = holder or self.read()
        if holder is not None and holder.token == self.me.token:  # this process again (another manager)
            self._write()
            self.held = True
            return
        if holder is not None:
            why = self.free_because(holder)
            if why is None:
                raise CheckpointError(
                    f"{self.where} is in use by another run ({holder.describe(self.clock())}); two runs writing one "
                    f"folder would mix their checkpoints. Stop that run or save elsewhere; its lease is free once "
                    f"its heartbeat is older than ckpt.lease_timeout ({self.timeout_s:g} s)")
            logger.warning("lease of %s: taking it over from %s: %s", self.storage.url,
                           holder.describe(self.clock()), why)
        self._write()
        if self.settle_s > 0:
            time.sleep(self.settle_s)
        now = self.read()
        if now is None or now.token != self.me.token:
            other = now.describe(self.clock()) if now is not None else "a run that removed it"
            raise CheckpointError(f"{self.where} was taken by another run at the same moment ({other}); refusing "
                                  "to write into it")
        self.held = True
        logger.info("lease of %s taken (heartbeat every %.0f s)", self.storage.url, self.interval_s)

    @property
    def interval_s(self) -> float:
        return max(0.5, self.timeout_s / 4)

    def check(self) -> None:
        """CheckpointError unless this process still holds the lease (rank 0, before a marker)."""
        if not self.held:
            return
        holder = self.read()
        if self.lost is None and holder is not None and holder.token != self.me.token:
            self.lost = holder.describe(self.clock())
        if holder is None and self.lost is None:  # removed by hand: this run still holds it
            self._write()
        if self.lost is not None:
            raise CheckpointError(f"{self.where}: this run lost its lease to {self.lost}; it saves no more "
                                  "checkpoints there")

    def renew(self) -> None:
        """One heartbeat: the lease gets the current time, unless another run holds it now (then `lost` is set)."""
        holder = self.read()
        if holder is not None and holder.token != self.me.token:
            if self.lost is None:
                self.lost = holder.describe(self.clock())
                logger.error("lease of %s: taken over by %s; this run saves no more checkpoints there",
                             self.storage.url, self.lost)
            return
        self._write()

    def start_heartbeat(self) -> None:
        if self._thread is not None or not self.held:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="internlm_core-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        warned = False
        while not self._stop.wait(self.interval_s):
            try:
                self.renew()
                warned = False
            except Exception as e:  # noqa: BLE001 - a storage hiccup: try again at the next beat
                if not warned:
                    logger.warning("lease of %s: heartbeat failed (%s); retrying", self.storage.url, e)
                    warned = True
            if self.lost is not None:
                return

    def release(self) -> None:
        """Stop the heartbeat and remove the lease (if it is still this process's)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if not self.held:
            return
        self.held = False
        try:
            holder = self.read()
            if holder is not None and holder.token == self.me.token:
                self.storage.remove_file("", LEASE)
        except Exception as e:  # noqa: BLE001 - the next run takes a stale lease over anyway
            logger.warning("lease of %s: could not release it (%s)", self.storage.url, e)
