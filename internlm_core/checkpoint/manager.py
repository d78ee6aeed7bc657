"""CheckpointManager: sharded, asynchronous save and exact resume on torch.distributed.checkpoint (DCP).

    ckpt = CheckpointManager(cfg.ckpt, rank=..., world_size=..., dims=dims, config_text=yaml_text)
    ckpt.register_model(model, optimizer)                                    # content "model" / "optimizer"
    ckpt.register("lr_scheduler", lr_scheduler, content="scheduler")         # anything with state_dict()
    ckpt.register("data", train_loader, content="sampler", scope="dp_rank")  # one state per data-parallel rank
    ckpt.register("rng", RNGState(), content="sampler", scope="rank", strict=False)
    ckpt.resume()                      # auto_resume's newest, else load_ckpt_info, else nothing
    ...
    ckpt.save(step, reason)            # blocks while state is copied to CPU memory; the rest runs in the background
    ckpt.close()                       # waits for the last save (and upload); CheckpointError if it failed

Model and optimizer go through `get_state_dict` / `set_state_dict` (plain modules, FSDP2 and DTensor tensor
parallel alike) and are resharded by DCP on load, so a checkpoint saved by N processes loads on M. Everything
else is a registered Stateful saved in the same DCP checkpoint (`global`: one copy; `dp_rank`: one per
data-parallel rank; `rank`: one per process). See `storage.py` for the folder layout and `meta.RESUME_NOTES` for
what a resume restores exactly.

The manager orchestrates: what is saved (registry.py) and what a checkpoint records (meta.py), when and where a
save goes (retention.py), the write itself (writer.py), which checkpoint a path names (catalog.py) and the load
(restore.py), all on one storage (storage.py, s3.py) and the checkpoint's own process group (collectives.py).
"""

from __future__ import annotations

import getpass
import hashlib
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch

from ..errors import CheckpointError
from ..utils.logging import get_logger
from .catalog import CheckpointRef, find_complete_checkpoints, latest_checkpoint, parse_destination, read_meta, resolve
from .collectives import Collectives
from .integrity import CorruptCheckpoint, verify_local
from .lease import Lease
from .meta import build_meta
from .registry import CONTENTS, StateRegistry, normalize_content
from .restore import FOREIGN_LOADERS, LoadResult, local_copy, read_into
from .retention import SnapshotSlots
from .storage import REJECTED, Storage
from .writer import CheckpointWriter, SaveResult, write_target

if TYPE_CHECKING:
    from ..config.schema import CkptConfig

logger = get_logger(__name__)
# one process without a process group is the intent here, not an accident
warnings.filterwarnings("ignore", message=r".*assuming the intent is to (save|load) in a single process.*")


def default_tmp_root(url: str) -> Path:
    """A per-user, per-destination folder under the system's temporary folder (staging and downloads)."""
    digest = hashlib.sha1(url.encode()).hexdigest()[:12]
    try:
        user = getpass.getuser()
    except Exception:
        user = "user"
    return Path(tempfile.gettempdir()) / f"internlm_core_ckpt_{user}_{digest}"


class CheckpointManager:
    """Save, find and load checkpoints of one run (see the module docstring).

    Args:
        cfg: the `ckpt` section.
        rank, world_size, local_rank: this process in the job (local_rank: its index on its node; node-local
            downloads are done by local rank 0).
        dims: ParallelDims (dp rank and the layout recorded in meta.json); None: plain data parallel.
        config_text: the run's resolved config, stored in meta.json and config.yaml.
        alerts: anything with `send(subject, content, level)` (the monitor's AlertManager) for failed saves, corrupt
            checkpoints and rewinds.
        upload_attempts, retry_backoff_s: object-storage retries (exponential backoff).
        group_timeout_s: timeout of the checkpoint process group (an upload may take long).
        run_dir: this run's folder (named in the folder's lease, so that a refused run learns whose it is).
    """

    def __init__(self, cfg: CkptConfig, *, rank: int = 0, world_size: int = 1, local_rank: int = 0,
                 dims: Any = None, config_text: str = "", alerts: Any = None, upload_attempts: int = 3,
                 retry_backoff_s: float = 2.0, group_timeout_s: float = 3600.0, run_dir: str | Path = ""):
        self.cfg = cfg
        self.alerts = alerts
        self.run_dir = str(run_dir)
        self.dims = dims
        self.config_text = config_text
        self.attempts, self.backoff_s = int(upload_attempts), float(retry_backoff_s)
        self.coll = Collectives(rank, world_size, local_rank, group_timeout_s)
        self.rank, self.world_size, self.local_rank = self.coll.rank, self.coll.world_size, self.coll.local_rank
        self.dest: Optional[Storage] = (parse_destination(cfg.save_ckpt_folder, self.attempts, self.backoff_s)
                                        if cfg.save_ckpt_folder else None)
        self.save_enabled = bool(cfg.enable_save_ckpt and self.dest is not None)
        self.tmp_root = (Path(cfg.async_upload_tmp_folder) if cfg.async_upload_tmp_folder
                         else default_tmp_root(self.dest.url if self.dest else "none"))
        self.state = StateRegistry()
        self._writer: Optional[CheckpointWriter] = None
        if self.dest is not None:
            self._slots = SnapshotSlots(self.dest, self.coll)
            self._writer = CheckpointWriter(self.dest, self.coll, self._slots, async_save=cfg.async_upload,
                                            keep_last_k=cfg.keep_last_k, config_text=config_text, alerts=alerts)
        self._warned_disabled = False
        # one live writer per folder (lease.py): taken by rank 0 at resume(), checked before every marker
        timeout = float(cfg.lease_timeout or 0)
        self.lease: Optional[Lease] = (Lease(self.dest, timeout, str(run_dir)) if self.save_enabled and timeout > 0
                                       and self.rank == 0 else None)
        if self.lease is not None and self._writer is not None:
            self._writer.may_commit = self.lease.check
        self.last_saved_step: Optional[int] = None
        self.loaded: Optional[LoadResult] = None
        self.model_type: Optional[str] = None

    # ---- registration --------------------------------------------------------------------------------------------
    def register_model(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                       model_type: Optional[str] = None) -> None:
        """The model (content "model") and its optimizer (content "optimizer"), through DCP's state_dict API;
        `model_type` picks the family's adapters for checkpoints of other formats (load_ckpt_info.ckpt_type)."""
        self.state.register_model(model, optimizer)
        self.model_type = model_type

    def register(self, name: str, obj: Any, *, content: str, scope: str = "global", strict: bool = True) -> None:
        """Save `obj.state_dict()` under `name` and restore it with `obj.load_state_dict()` when `content` is loaded.

        scope: "global" (the same on every rank, saved once), "dp_rank" (one per data-parallel rank) or "rank"
        (one per process). strict=False: restore only the parts the checkpoint has (e.g. no CUDA RNG state in a
        checkpoint from a CPU run). `obj` None is ignored (e.g. no grad scaler outside fp16).
        """
        self.state.register(name, obj, content=content, scope=scope, strict=strict)

    @property
    def registered(self) -> dict[str, tuple[str, str]]:
        """{name: (content, scope)} of everything saved besides model and optimizer."""
        return self.state.registered

    # ---- layout --------------------------------------------------------------------------------------------------
    def layout(self) -> dict[str, int]:
        """The parallel layout recorded in meta.json (a resume with the same one is exact)."""
        d = self.dims
        if d is None:
            return {"world_size": self.world_size, "dp": self.world_size, "dp_shard": self.world_size,
                    "dp_replicate": 1, "tp": 1, "pp": 1, "zero1": -1}
        return d.record()

    @property
    def dp_rank(self) -> int:
        return int(self.dims.dp_rank) if self.dims is not None else self.rank

    # ---- saving ----------------------------------------------------------------------------------------------------
    @property
    def results(self) -> list[SaveResult]:
        """Every save of this manager so far, oldest first."""
        return self._writer.results if self._writer is not None else []

    @property
    def last_result(self) -> Optional[SaveResult]:
        return self._writer.last_result if self._writer is not None else None

    def should_save(self, step: int) -> Optional[str]:
        """"regular" at multiples of checkpoint_every, else "snapshot" at multiples of oss_snapshot_freq, else None."""
        if not self.save_enabled or step <= 0:
            return None
        if self.cfg.checkpoint_every > 0 and step % self.cfg.checkpoint_every == 0:
            return "regular"
        if self.cfg.oss_snapshot_freq > 0 and step % self.cfg.oss_snapshot_freq == 0:
            return "snapshot"
        return None

    def save(self, step: int, reason: str = "", kind: str = "regular") -> Optional[str]:
        """Save the registered state as checkpoint `step` (kind "regular" or "snapshot"); every rank calls it.

        Waits for the previous save first. Async (`async_upload`): returns once the state is copied to CPU memory.
        Sync: returns when the checkpoint is complete. Returns the checkpoint's URL (None when saving is off).
        A failed save is logged as an error on every rank (and alerted); it never removes an older checkpoint.
        """
        if not self.save_enabled or self._writer is None or self.dest is None:
            if not self._warned_disabled:
                self._warned_disabled = True
                logger.warning("checkpoint at step %d requested (%s) but saving is off (ckpt.enable_save_ckpt / "
                               "ckpt.save_ckpt_folder)", step, reason or kind)
            return None
        if kind not in ("regular", "snapshot"):
            raise ValueError(f"kind must be regular or snapshot, got {kind!r}")
        self.wait()
        lost = self.coll.broadcast(self.lease.lost if self.lease is not None else None)
        if lost is not None:
            raise CheckpointError(f"{self.dest.url}: this run lost the folder's lease to {lost}; stopping instead of "
                                  "writing checkpoints two runs would mix")
        t0 = time.perf_counter()
        name = str(step) if kind == "regular" else self._slots.next()
        result = SaveResult(step, kind, name, self.dest.child(name), reason)
        target = write_target(self.dest, name, self.tmp_root)
        target.prepare(self.coll)
        state = self.state.collect(self.dp_rank, self.rank)
        per_dp = self.state.dp_rank_states(self.coll, self.dp_rank)
        meta = (build_meta(self.state, step=step, kind=kind, reason=reason, name=name, per_dp=per_dp,
                           layout=self.layout(), config_text=self.config_text) if self.rank == 0 else None)
        self.last_saved_step = step
        self._writer.write(state, target, result, meta, t0)
        return result.url

    def wait(self) -> Optional[SaveResult]:
        """Block until the last save has completed (or failed); its result."""
        return self._writer.wait() if self._writer is not None else None

    def close(self) -> None:
        """Wait for the last save; CheckpointError if it did not complete (the job must not look successful).
        The folder's lease is given back."""
        try:
            if self._writer is not None:
                self._writer.close()
        finally:
            if self.lease is not None:
                self.lease.release()

    def claim(self) -> None:
        """Take the folder's lease (rank 0; a collective): CheckpointError on every rank when another live run
        writes there. Done by `resume()`; a no-op without saving or with ckpt.lease_timeout 0."""
        if not self.save_enabled:
            return
        error = None
        if self.lease is not None and not self.lease.held:
            self.lease.me.run_dir = self.run_dir
            try:
                self.lease.acquire()
                self.lease.start_heartbeat()
            except CheckpointError as e:
                error = str(e)
        error = self.coll.broadcast(error)
        if error is not None:
            raise CheckpointError(error)

    # ---- loading ---------------------------------------------------------------------------------------------------
    def complete_checkpoints(self, dest: Optional[Storage] = None) -> list[CheckpointRef]:
        """Every complete checkpoint under `dest` (default: save_ckpt_folder), oldest first, the same on every rank."""
        dest = dest or self.dest
        if dest is None:
            return []
        found = self.coll.on_rank0(lambda: [(r.name, r.marker) for r in find_complete_checkpoints(dest)])
        return [CheckpointRef(dest, name, marker) for name, marker in found]

    def _load_newest_sound(self, dest: Storage, before_step: Optional[int] = None) -> Optional[LoadResult]:
        """Load the newest complete checkpoint under `dest` (older than `before_step`) whose files match their
        checksums; a corrupt one is rejected (REJECTED file, alert) and the one before it tried. None: no sound one."""
        for ref in reversed(self.complete_checkpoints(dest)):
            if before_step is not None and ref.step >= before_step:
                continue
            try:
                return self._load_ref(ref, CONTENTS)
            except CorruptCheckpoint as e:
                self._reject(ref, str(e), "corrupt checkpoint: falling back to the one before it")
        return None

    def _reject(self, ref: CheckpointRef, why: str, subject: str) -> None:
        """Rank 0: `ref` stops counting as complete (its files stay), with an error log and an alert."""
        if self.rank != 0:
            return
        logger.error("%s; %s is rejected (its files stay; its marker is kept in %s/%s)", why, ref.url, ref.url,
                     REJECTED)
        try:
            ref.storage.reject(ref.name, why)
        except Exception as e:  # noqa: BLE001 - still never loaded by this run; the next resume checks it again
            logger.error("could not mark %s as rejected: %s", ref.url, e)
        if self.alerts is not None:
            try:
                self.alerts.send(subject, why, level="error")
            except Exception as e:  # noqa: BLE001
                logger.error("alerting failed too: %s", e)

    def rewind(self, before_step: int, reason: str) -> LoadResult:
        """Reload everything from the newest sound checkpoint older than `before_step` (a collective); complete
        checkpoints of step `before_step` or later are rejected first (saved after things went wrong)."""
        self.wait()
        if self.dest is None:
            raise CheckpointError("rewind: no ckpt.save_ckpt_folder to rewind from")
        for ref in self.complete_checkpoints():
            if ref.step >= before_step:
                self._reject(ref, f"{reason}: checkpoint of step {ref.step} saved at or after step {before_step}",
                             f"checkpoint of step {ref.step} rejected")
        res = self._load_newest_sound(self.dest, before_step)
        if res is None:
            raise CheckpointError(f"rewind ({reason}): no complete checkpoint before step {before_step} under "
                                  f"{self.dest.url}")
        self.last_saved_step = res.step
        return res

    def find_latest(self, dest: Optional[Storage] = None) -> Optional[CheckpointRef]:
        """The newest complete checkpoint under `dest` (default: save_ckpt_folder), the same on every rank."""
        dest = dest or self.dest
        if dest is None:
            return None
        found = self.coll.on_rank0(lambda: (lambda r: (r.name, r.marker) if r else None)(latest_checkpoint(dest)))
        return CheckpointRef(dest, found[0], found[1]) if found else None

    def resume(self) -> Optional[LoadResult]:
        """At start: with auto_resume the newest complete checkpoint under save_ckpt_folder (everything is loaded);
        when there is none yet (a job's first start), `load_ckpt_info` (its content) is the starting point when
        something is there, else the run starts fresh with a warning (InternLM's configs ship a placeholder path
        under auto_resume). Without auto_resume: `load_ckpt_info` (a path holding nothing is refused), else nothing.
        InternLM ignored load_ckpt_info under auto_resume even on a first start, so a continued pretraining job that
        kept the default trained from random weights. One log line says which.
        The newest complete checkpoint whose files fail their checksums is rejected (with an alert) and the one
        before it is taken. First of all the folder's lease is taken (one live writer per folder)."""
        self.claim()
        info = self.cfg.load_ckpt_info
        if self.cfg.auto_resume:
            res = self._load_newest_sound(self.dest) if self.dest is not None else None
            if res is not None:
                self.last_saved_step = res.step
                return res
            where = f"under {self.dest.url}" if self.dest is not None else "(no ckpt.save_ckpt_folder)"
            if info is not None and info.path and not self.coll.on_rank0(lambda: self._nothing_at(info.path)):
                if self.rank == 0:
                    logger.info("start: no complete checkpoint %s yet (auto_resume): loading load_ckpt_info %s (%s)",
                                where, info.path, info.ckpt_type)
                return self.load(info.path, info.content, info.ckpt_type)
            if self.rank == 0:
                fresh = f"start: no complete checkpoint {where} (auto_resume): fresh {', '.join(CONTENTS)}"
                if info is not None and info.path:
                    logger.warning("%s; load_ckpt_info %s (%s) not used: nothing there (with auto_resume=False a "
                                   "path holding nothing is refused)", fresh, info.path, info.ckpt_type)
                else:
                    logger.info(fresh)
            return None
        if info is not None and info.path:
            return self.load(info.path, info.content, info.ckpt_type)
        if self.rank == 0:
            logger.info("start: nothing to load (auto_resume off, no load_ckpt_info): fresh %s", ", ".join(CONTENTS))
        return None

    def _nothing_at(self, path: str) -> bool:
        """Whether `path` (a checkpoint, a folder of them or a foreign folder) holds nothing at all."""
        storage = parse_destination(path, self.attempts, self.backoff_s)
        local = storage.local_path("")
        if local is not None:
            return not local.exists() or not any(local.iterdir())
        return not storage.list_names() and not storage.file_sizes("")

    def load(self, path: str, content: Iterable[str] | str | None = ("all",),
             ckpt_type: str = "internlm_core") -> LoadResult:
        """Load a checkpoint folder (or the newest complete one under a folder of them) into the registered state."""
        parts = normalize_content(content)
        if ckpt_type != "internlm_core":
            return self._load_foreign(path, parts, ckpt_type)
        storage = parse_destination(path, self.attempts, self.backoff_s)

        def find() -> tuple[str, dict]:
            ref = resolve(storage, incomplete=("checkpoint {url} is incomplete (no COMPLETE marker): it was "
                                               "interrupted while being written; load an older one"),
                          nothing="{url}: no complete checkpoint there (ckpt.load_ckpt_info.path)")
            return ref.name, ref.marker

        name, marker = self.coll.on_rank0(find)
        return self._load_ref(CheckpointRef(storage, name, marker), parts)

    def _load_foreign(self, path: str, parts: tuple[str, ...], ckpt_type: str) -> LoadResult:
        """The model's weights from a checkpoint of another format (`FOREIGN_LOADERS`)."""
        fn = FOREIGN_LOADERS.get(ckpt_type)
        if fn is None:
            raise CheckpointError(f"ckpt.load_ckpt_info.ckpt_type: no loader for {ckpt_type!r} in this build "
                                  f"(available: internlm_core{''.join(', ' + k for k in sorted(FOREIGN_LOADERS))})")
        storage = parse_destination(path, self.attempts, self.backoff_s)
        folder = storage.local_path("")
        if folder is None:
            raise CheckpointError(f"{storage.url}: a {ckpt_type} checkpoint is read from a local folder; download "
                                  "it first")
        if self.state.model is None:
            raise CheckpointError("no model registered with the checkpoint manager")
        t0 = time.perf_counter()
        info = self.cfg.load_ckpt_info
        keep = tuple(info.keep_run_keys) if ckpt_type in ("hf", "hf_llama") and info is not None else ()
        loaded = fn(self.state.model, folder, self.model_type, **({"keep": keep} if keep else {}))
        self.loaded = LoadResult(storage.url, 0, ("model",), True)
        if self.rank == 0:
            asked = [c for c in parts if c != "model"]
            logger.info("loaded %s (type %s; content model) in %.2f s: took model (%d tensors); fresh %s%s",
                        storage.url, ckpt_type, time.perf_counter() - t0, len(loaded),
                        ", ".join(c for c in CONTENTS if c != "model"),
                        f" (a {ckpt_type} checkpoint holds no {', '.join(asked)} for this run)" if asked else "")
        return self.loaded

    def _load_ref(self, ref: CheckpointRef, parts: tuple[str, ...]) -> LoadResult:
        t0 = time.perf_counter()
        folder, cleanup = local_copy(ref, self.coll, self.tmp_root / "download")
        try:
            verify_local(folder, ref.marker, self.coll, shared=ref.storage.local_path(ref.name) is not None,
                         url=ref.url)
            saved = read_meta(folder)
            notes = read_into(self.state, folder, ref.url, parts, self.coll, self.dp_rank)
        finally:
            cleanup()
        same = saved.get("layout") == self.layout()
        res = LoadResult(ref.url, ref.step, parts, same, saved.get("layout", {}), notes)
        self.loaded = res
        if self.rank == 0:
            how = ("same layout: exact resume" if same else
                   f"layout changed from {saved.get('layout')} to {self.layout()}: model, optimizer and schedules "
                   "exact; data position and RNG as described in the checkpoint's meta.json")
            fresh = [c for c in CONTENTS if c not in parts]
            logger.info("loaded %s (step %d, %s; content %s) in %.2f s: took %s from an internlm_core checkpoint; "
                        "fresh %s; %s%s", ref.url, ref.step, ref.kind, ",".join(parts), time.perf_counter() - t0,
                        ", ".join(parts), ", ".join(fresh) or "nothing", how, "".join(f"; {n}" for n in notes))
        return res
