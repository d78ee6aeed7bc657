"""Writing one checkpoint, one save at a time.

DCP writes the shards (with `async_upload`: from a CPU copy, in a background thread, while training goes on); then,
on every rank in the same order (collectives on the checkpoint's own gloo group): each rank's files are made
durable, rank 0 adds meta.json and config.yaml, the files reach the storage (written in place, or staged on each
node and uploaded by every rank, its own files), rank 0 writes the COMPLETE marker last (after every rank reported
its files) and applies `keep_last_k`. A failed save is logged on every rank and alerted; it never removes an older
checkpoint.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed.checkpoint as dcp

from ..errors import CheckpointError
from ..utils.logging import get_logger
from . import events
from .collectives import Collectives
from .integrity import checksums
from .meta import build_marker
from .retention import SnapshotSlots, keep_last_k
from .safe_dcp import DCP_ERRORS, InterruptibleWriter, describe, unwrap
from .staging import ReusingCPUStager
from .storage import CONFIG, DCP_METADATA, MARKER, META, Storage, write_durable

logger = get_logger(__name__)


@dataclass
class SaveResult:
    """How one save went; `ok` once its marker is written (and uploaded)."""

    step: int
    kind: str
    name: str
    url: str
    reason: str = ""
    ok: bool = False
    error: str = ""
    blocked_s: float = 0.0
    total_s: float = 0.0
    bytes: int = 0


class WriteTarget(ABC):
    """The local folder DCP writes checkpoint `name` into, and how its files then reach the storage."""

    kept_note = ""  # what a failure message says about the written files

    def __init__(self, storage: Storage, name: str, folder: Path):
        self.storage, self.name, self.folder = storage, name, folder

    @abstractmethod
    def _clear(self, coll: Collectives) -> None:
        """Remove what an earlier checkpoint of the same name left in the way (OSError on failure)."""

    def prepare(self, coll: Collectives) -> None:
        """An empty folder to write into on every rank (an old checkpoint of the same name is set aside first)."""
        err = ""
        try:
            self._clear(coll)
        except OSError as e:
            err = f"clearing {self.folder}: {e}"
        coll.barrier()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            err = err or f"creating {self.folder}: {e}"
        ok, err = coll.agree(not err, err)
        if not ok:
            raise CheckpointError(f"checkpoint {self.storage.child(self.name)}: {err}")

    def publish(self, files: dict[str, int], coll: Collectives) -> tuple[bool, str]:
        """Every rank's `files` in the storage; (every rank succeeded, what failed where)."""
        return True, ""

    def cleanup(self, ok: bool, coll: Collectives) -> None:
        """After the save (complete when `ok`): what was set aside goes."""
        if coll.rank == 0:
            self.storage.empty_trash()


class InPlace(WriteTarget):
    """DCP writes straight into the storage's folder (a local or shared file system)."""

    def _clear(self, coll: Collectives) -> None:
        if coll.rank == 0:
            self.storage.set_aside(self.name)


class Staged(WriteTarget):
    """DCP writes into a folder on each node; every rank then uploads its own files."""

    def __init__(self, storage: Storage, name: str, folder: Path):
        super().__init__(storage, name, folder)
        self.kept_note = f"; the local copy stays in {folder}"

    def _clear(self, coll: Collectives) -> None:
        if coll.local_rank == 0 and self.folder.exists():
            shutil.rmtree(self.folder, ignore_errors=True)

    def publish(self, files: dict[str, int], coll: Collectives) -> tuple[bool, str]:
        """Rank 0 removes what the storage holds under the name; then each rank uploads its own files."""
        ok, error = True, ""
        if coll.rank == 0:
            try:
                self.storage.delete(self.name)
            except Exception as e:
                ok, error = False, f"clearing {self.storage.child(self.name)}: {e}"
        ok, error = coll.agree(ok, error)
        if not ok:
            return ok, error
        try:
            for fname in sorted(files):
                self.storage.upload_file(self.folder / fname, self.name, fname)
        except Exception as e:
            ok, error = False, str(e)
        return coll.agree(ok, error)

    def cleanup(self, ok: bool, coll: Collectives) -> None:
        """The local copy goes once the checkpoint is complete (it stays after a failure)."""
        super().cleanup(ok, coll)
        if ok:
            coll.barrier()
            if coll.local_rank == 0:
                shutil.rmtree(self.folder, ignore_errors=True)


def write_target(storage: Storage, name: str, staging_root: Path) -> WriteTarget:
    """In place where the storage is a folder of this machine, else staged under `staging_root`/upload."""
    folder = storage.local_path(name)
    if folder is not None:
        return InPlace(storage, name, folder)
    return Staged(storage, name, staging_root / "upload" / name.replace("/", "_"))


class CheckpointWriter:
    """Runs the saves of one run, one at a time (see the module docstring).

    async_save: return once the state is copied to CPU memory, the rest in a background thread.
    keep_last_k: retention of regular checkpoints after each complete save. alerts: anything with
    `send(subject, content, level)`, told about failed saves.
    """

    def __init__(self, storage: Storage, coll: Collectives, slots: SnapshotSlots, *, async_save: bool,
                 keep_last_k: int, config_text: str, alerts: Any = None):
        self.storage, self.coll, self.slots = storage, coll, slots
        self.async_save, self.keep_last_k = async_save, keep_last_k
        self.config_text, self.alerts = config_text, alerts
        self._thread: Optional[threading.Thread] = None
        self._stager: Optional[ReusingCPUStager] = None
        # rank 0, right before a marker is written: raises when this run may no longer commit (its lease was taken)
        self.may_commit: Optional[Callable[[], None]] = None
        self.last_result: Optional[SaveResult] = None
        self.results: list[SaveResult] = []

    def write(self, state: dict, target: WriteTarget, result: SaveResult, meta: Optional[dict], t0: float) -> None:
        """Hand `state` (DCP's view of everything) to DCP; `meta` is rank 0's meta.json (None elsewhere)."""
        writer = InterruptibleWriter(target.folder, result.step)
        if self.async_save:
            if self._stager is None:  # kept: its CPU buffers are reused by the next save
                self._stager = ReusingCPUStager()  # one host buffer, pinned in place when the state is on a GPU
            try:
                fut = dcp.async_save(state, storage_writer=writer, async_stager=self._stager,
                                     **self.coll.dcp_kwargs())
            except DCP_ERRORS as e:
                raise CheckpointError(f"checkpoint {result.url}: staging failed on rank {self.coll.rank}: "
                                      f"{describe(unwrap(e))}") from e
            fut = getattr(fut, "upload_completion", fut)
            del state
            result.blocked_s = time.perf_counter() - t0
            self._thread = threading.Thread(target=self._finish, args=(fut, "", target, meta, result, t0),
                                            name="internlm_core-checkpoint", daemon=True)
            self._thread.start()
            if self.coll.rank == 0:
                logger.info("checkpoint %s (step %d, %s): training blocked %.3f s while staging; writing in the "
                            "background", result.url, result.step, result.reason or result.kind, result.blocked_s)
        else:
            err = ""
            try:
                dcp.save(state, storage_writer=writer, **self.coll.dcp_kwargs())
            except DCP_ERRORS as e:
                err = f"writing {target.folder}: {describe(unwrap(e))}"
            del state
            self._finish(None, err, target, meta, result, t0)
            result.blocked_s = time.perf_counter() - t0

    def _my_files(self, folder: Path) -> tuple[dict[str, int], dict[str, str]]:
        """The files this rank is responsible for (its DCP shards; rank 0 also the index, meta and config): their
        sizes and their checksums."""
        files = {p.name: p.stat().st_size for p in folder.glob(f"__{self.coll.rank}_*") if p.is_file()}
        if self.coll.rank == 0:
            for fname in (DCP_METADATA, META, CONFIG):
                files[fname] = (folder / fname).stat().st_size
        return files, checksums(folder, files)

    def _finish(self, fut: Any, err: str, target: WriteTarget, meta: Optional[dict], result: SaveResult,
                t0: float) -> None:
        """Everything after the shards are handed to DCP: on every rank, in the same order (collectives)."""
        coll, ok, error = self.coll, not err, err
        try:
            if fut is not None:
                try:
                    fut.result()
                except DCP_ERRORS as e:
                    ok, error = False, f"writing {target.folder}: {describe(unwrap(e))}"
            files: dict[str, int] = {}
            sums: dict[str, str] = {}
            if ok:
                try:
                    if coll.rank == 0:
                        write_durable(target.folder / META, json.dumps(meta, indent=1, default=str).encode())
                        write_durable(target.folder / CONFIG, self.config_text.encode())
                    files, sums = self._my_files(target.folder)
                except OSError as e:
                    ok, error = False, f"{target.folder}: {e}"
            ok, error = coll.agree(ok, error)
            if ok:
                ok, error = target.publish(files, coll)
            gathered = coll.all_gather((files, sums) if ok else ({}, {}))
            if coll.rank == 0 and ok:
                ok, error = self._commit(result, gathered, meta)
            ok, error, result.bytes = coll.broadcast((ok, error, result.bytes))
            if ok and result.kind == "snapshot":
                self.slots.completed(result.name)
            target.cleanup(ok, coll)
        except DCP_ERRORS as e:  # a peer died in a collective, or a bug: this save did not complete
            ok, error = False, describe(unwrap(e))
        result.ok, result.error = ok, error
        result.total_s = time.perf_counter() - t0
        self.last_result = result
        self.results.append(result)
        self._report(result, target)

    def _commit(self, result: SaveResult, gathered: list[tuple[dict[str, int], dict[str, str]]],
                meta: Optional[dict]) -> tuple[bool, str]:
        """Rank 0: the COMPLETE marker listing every rank's files and checksums, then retention."""
        files: dict[str, int] = {}
        sums: dict[str, str] = {}
        for f, c in gathered:
            files.update(f)
            sums.update(c)
        marker = build_marker(step=result.step, kind=result.kind, name=result.name, reason=result.reason,
                              world_size=self.coll.world_size, time=(meta or {}).get("time", ""), files=files,
                              checksums=sums)
        result.bytes = sum(files.values())
        if self.may_commit is not None:
            try:
                self.may_commit()
            except CheckpointError as e:
                return False, str(e)
        try:
            events.emit("before_marker", result.step)
            self.storage.put_text(result.name, MARKER, json.dumps(marker, indent=1))
        except Exception as e:
            return False, f"writing the {MARKER} marker: {type(e).__name__}: {e}"
        if result.kind == "regular":
            keep_last_k(self.storage, self.keep_last_k, result.name)
        return True, ""

    def _report(self, result: SaveResult, target: WriteTarget) -> None:
        if result.ok:
            if self.coll.rank == 0:
                logger.info("checkpoint %s complete: step %d, %.1f MB in %.2f s (training blocked %.3f s)",
                            result.url, result.step, result.bytes / 1e6, result.total_s, result.blocked_s)
            return
        msg = (f"CHECKPOINT FAILED: step {result.step} at {result.url} did not complete: {result.error}"
               f"{target.kept_note}. Older checkpoints are untouched; training goes on and the next save tries "
               f"again.")
        logger.error(msg)
        if self.alerts is not None and self.coll.rank == 0:
            try:
                self.alerts.send(f"checkpoint of step {result.step} failed", msg, level="error")
            except Exception as e:
                logger.error("alerting about the failed checkpoint failed too: %s", e)

    def wait(self) -> Optional[SaveResult]:
        """Block until the last save has completed (or failed); its result."""
        t = self._thread
        if t is not None:
            t.join()
            self._thread = None
        return self.last_result

    def close(self) -> None:
        """Wait for the last save; CheckpointError if it did not complete (the job must not look successful)."""
        res = self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if res is not None and not res.ok:
            good = [r for r in self.results if r.ok]
            newest = f"the newest complete one is {good[-1].url}" if good else "no checkpoint of this run completed"
            raise CheckpointError(f"the last checkpoint (step {res.step}, {res.url}) did not complete: {res.error}; "
                                  f"{newest}")
