"""CheckpointManager: sharded, asynchronous save and exact resume on torch.distributed.checkpoint (DCP).

    ckpt = CheckpointManager(cfg.ckpt, rank=..., world_size=..., dims=dims, config_text=yaml_text)
    ckpt.register_model(model, optimizer)                                    # content "model" / "optimizer"
    ckpt.register("lr_scheduler", lr_scheduler, content="scheduler")         # anything with state_dict()
    ckpt.register("data", train_loader, content="sampler", scope="dp_rank")  # one state per data-parallel rank
    ckpt.register("rng", RNGState(), content="sampler", scope="rank", strict=False)
    ckpt.resume()                      # auto_resume, else load_ckpt_info, else nothing
    ...
    ckpt.save(step, reason)            # blocks while state is copied to CPU memory; the rest runs in the background
    ckpt.close()                       # waits for the last save (and upload); CheckpointError if it failed

Model and optimizer go through `get_state_dict` / `set_state_dict` (plain modules, FSDP2 and DTensor tensor
parallel alike) and are resharded by DCP on load, so a checkpoint saved by N processes loads on M. Everything
else is a registered Stateful saved in the same DCP checkpoint (`global`: one copy; `dp_rank`: one per
data-parallel rank; `rank`: one per process). See `storage.py` for the folder layout and `RESUME_NOTES` for what
a resume restores exactly.

Saving: `save` waits for the previous save, stages the state into CPU memory (`dcp.async_save`), and returns;
a background thread then waits for the shards to be written (fsync), writes meta.json and config.yaml, uploads
to object storage when the destination is `s3://` (each rank its own shards, with retries), and finally writes
the COMPLETE marker (rank 0, atomically, after every rank reported its files durable) and applies `keep_last_k`.
The background thread and DCP's own use a dedicated gloo process group, never the training's groups.
"""

from __future__ import annotations

import datetime
import getpass
import hashlib
import importlib
import json
import os
import platform
import re
import shutil
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import CheckpointError
from ..utils.logging import get_logger
from . import faults
from .safe_dcp import InterruptibleWriter, SafeFileSystemReader, SafeLoadPlanner, flat_keys, read_dcp_metadata
from .staging import ReusingCPUStager
from .storage import (CONFIG, DCP_METADATA, MARKER, META, SNAPSHOT_SLOTS, Destination, LocalDestination,
                      S3Destination, fsync_dir, parse_destination, write_durable)

logger = get_logger(__name__)
# one process without a process group is the intent here, not an accident
warnings.filterwarnings("ignore", message=r".*assuming the intent is to (save|load) in a single process.*")

FORMAT = "internlm_core/dcp"
FORMAT_VERSION = 1
CONTENTS = ("model", "sampler", "optimizer", "scheduler")
SCOPES = ("global", "dp_rank", "rank")
_RESERVED = ("model", "optimizer")

RESUME_NOTES = {
    "exact": "Resuming with the same world layout (world_size, dp, tp, pp, zero1) and the same model, optimizer and "
             "data config restores model and optimizer state, schedules, train state, every data-parallel rank's "
             "loader position and every rank's RNG streams, so training continues with the same batches and the "
             "loss trajectory of an uninterrupted run (bitwise, given deterministic kernels).",
    "other_layout": {
        "model": "exact: DCP reshards parameters between data/zero/tensor/pipeline layouts",
        "optimizer": "exact: optimizer state is resharded the same way",
        "scheduler": "exact: lr and beta2 schedules and the grad scaler are global",
        "train_state": "exact: step counts and consumed tokens are global (num_consumed_samples_in_epoch is per "
                       "data-parallel rank and is taken from the rank chosen below)",
        "data": "each data-parallel rank d takes the loader state saved by rank d (rank d mod the saved dp size when "
                "there are more ranks now). internlm_core's TrainLoader counts rows consumed by all ranks together "
                "(data_state shows whether every dp rank agreed), so no row is skipped or repeated; rows are "
                "grouped into steps differently when dp * micro_num changes, so the batches of a step differ",
        "rng": "not exact: rank r gets the streams saved by rank r (rank r mod the saved world size when there are "
               "more ranks now)",
        "loss": "not bitwise: gradient reductions run in another order",
    },
}


def normalize_content(content: Iterable[str] | str | None) -> tuple[str, ...]:
    """InternLM's load content → the parts to load, in CONTENTS order ("all" = everything)."""
    if content is None:
        return CONTENTS
    items = [content] if isinstance(content, str) else list(content)
    items = [str(c).lower() for c in items]
    bad = [c for c in items if c not in (*CONTENTS, "all")]
    if bad:
        raise CheckpointError(f"ckpt.load_ckpt_info.content: unknown {bad}; expected any of "
                              f"{', '.join(CONTENTS)}, all")
    if "all" in items:
        return CONTENTS
    return tuple(c for c in CONTENTS if c in items)


def library_versions() -> dict[str, str]:
    import internlm_core
    return {"internlm_core": str(getattr(internlm_core, "__version__", "0+unknown")), "torch": torch.__version__,
            "numpy": np.__version__, "python": platform.python_version()}


# ---- other checkpoint formats, model only (hf_llama: internlm_core.checkpoint.hf.load_hf_llama) ------------------
_MODEL_LOADERS: dict[str, Callable[[torch.nn.Module, str], Any]] = {}
_BUILTIN_LOADERS = {"hf_llama": ("hf", "load_hf_llama")}  # module of this package, function(model, path)


def register_model_loader(ckpt_type: str, fn: Callable[[torch.nn.Module, str], Any]) -> None:
    """`fn(model, path)` loads weights of format `ckpt_type` (a `load_ckpt_info.ckpt_type`) into the built,
    parallelized model. Model only: the optimizer and schedules start fresh."""
    _MODEL_LOADERS[ckpt_type] = fn


@dataclass
class CheckpointRef:
    """A complete checkpoint at a destination: `name` is its folder ("10", "snapshot/0", "" for the root itself)."""

    dest: Destination
    name: str
    marker: dict

    @property
    def step(self) -> int:
        return int(self.marker["step"])

    @property
    def kind(self) -> str:
        return str(self.marker.get("kind", "regular"))

    @property
    def url(self) -> str:
        return self.dest.child(self.name) if self.name else self.dest.url


def find_complete_checkpoints(dest: Destination) -> list[CheckpointRef]:
    """Every complete checkpoint under `dest` (regular and snapshot slots), oldest first; incomplete or damaged
    ones are skipped (damaged ones with a warning)."""
    refs = []
    for name in dest.list_names():
        marker = dest.read_marker(name)
        if marker is None:
            logger.info("checkpoint %s has no %s marker (interrupted while being written); ignored",
                        dest.child(name), MARKER)
            continue
        problem = dest.verify(name, marker)
        if problem:
            logger.warning("checkpoint %s is damaged (%s); ignored", dest.child(name), problem)
            continue
        refs.append(CheckpointRef(dest, name, marker))
    refs.sort(key=lambda r: (r.step, r.kind == "regular"))
    return refs


def latest_checkpoint(dest: Destination) -> Optional[CheckpointRef]:
    """The newest complete checkpoint under `dest` (the higher step; a regular one over a snapshot of that step)."""
    refs = find_complete_checkpoints(dest)
    return refs[-1] if refs else None


def default_tmp_root(url: str) -> Path:
    digest = hashlib.sha1(url.encode()).hexdigest()[:12]
    try:
        user = getpass.getuser()
    except Exception:
        user = "user"
    return Path(tempfile.gettempdir()) / f"internlm_core_ckpt_{user}_{digest}"


@dataclass
class _Entry:
    name: str
    obj: Any
    content: str
    scope: str
    strict: bool


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


@dataclass
class LoadResult:
    """What a load restored: from where, at which step, which content, and whether the layout matched."""

    url: str
    step: int
    content: tuple[str, ...]
    same_layout: bool
    saved_layout: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class CheckpointManager:
    """Save, find and load checkpoints of one run (see the module docstring).

    Args:
        cfg: the `ckpt` section (CkptConfig).
        rank, world_size, local_rank: this process in the job (local_rank: its index on its node; node-local
            downloads are done by local rank 0).
        dims: ParallelDims (dp rank and the layout recorded in meta.json); None: plain data parallel.
        config_text: the run's resolved config, stored in meta.json and config.yaml.
        alerts: anything with `send(subject, content, level)` (the monitor's AlertManager) for failed saves.
        upload_attempts, retry_backoff_s: object-storage retries (exponential backoff).
        group_timeout_s: timeout of the checkpoint process group (an upload may take long).
    """

    def __init__(self, cfg: Any, *, rank: int = 0, world_size: int = 1, local_rank: int = 0, dims: Any = None,
                 config_text: str = "", alerts: Any = None, upload_attempts: int = 3, retry_backoff_s: float = 2.0,
                 group_timeout_s: float = 3600.0):
        self.cfg = cfg
        self.rank, self.world_size, self.local_rank = int(rank), int(world_size), int(local_rank)
        self.dims = dims
        self.config_text = config_text
        self.alerts = alerts
        self.attempts, self.backoff_s = int(upload_attempts), float(retry_backoff_s)
        folder = getattr(cfg, "save_ckpt_folder", None)
        self.dest: Optional[Destination] = (parse_destination(folder, self.attempts, self.backoff_s)
                                            if folder else None)
        self.save_enabled = bool(getattr(cfg, "enable_save_ckpt", False) and self.dest is not None)
        self.async_save = bool(getattr(cfg, "async_upload", True))
        tmp = getattr(cfg, "async_upload_tmp_folder", None)
        self.tmp_root = Path(tmp) if tmp else default_tmp_root(self.dest.url if self.dest else "none")
        self.group: Optional[dist.ProcessGroup] = None
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=group_timeout_s))
        self._model: Optional[torch.nn.Module] = None
        self._optimizer: Optional[torch.optim.Optimizer] = None
        self._entries: dict[str, _Entry] = {}
        self._thread: Optional[threading.Thread] = None
        self._stager: Any = None
        self._next_slot: Optional[int] = None
        self._warned_disabled = False
        self.last_saved_step: Optional[int] = None
        self.last_result: Optional[SaveResult] = None
        self.results: list[SaveResult] = []
        self.loaded: Optional[LoadResult] = None

    # ---- registration --------------------------------------------------------------------------------------------
    def register_model(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """The model (content "model") and its optimizer (content "optimizer"), through DCP's state_dict API."""
        self._model, self._optimizer = model, optimizer

    def register(self, name: str, obj: Any, *, content: str, scope: str = "global", strict: bool = True) -> None:
        """Save `obj.state_dict()` under `name` and restore it with `obj.load_state_dict()` when `content` is loaded.

        scope: "global" (the same on every rank, saved once), "dp_rank" (one per data-parallel rank) or "rank"
        (one per process). strict=False: restore only the parts the checkpoint has (e.g. no CUDA RNG state in a
        checkpoint from a CPU run). `obj` None is ignored (e.g. no grad scaler outside fp16).
        """
        if obj is None:
            return
        if content not in CONTENTS:
            raise ValueError(f"register {name!r}: content must be one of {CONTENTS}, got {content!r}")
        if scope not in SCOPES:
            raise ValueError(f"register {name!r}: scope must be one of {SCOPES}, got {scope!r}")
        if name in _RESERVED or name in self._entries or "." in name:
            raise ValueError(f"register {name!r}: name taken, reserved or dotted")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"register {name!r}: {type(obj).__name__} has no state_dict()/load_state_dict()")
        self._entries[name] = _Entry(name, obj, content, scope, strict)

    @property
    def registered(self) -> dict[str, tuple[str, str]]:
        """{name: (content, scope)} of everything saved besides model and optimizer."""
        return {e.name: (e.content, e.scope) for e in self._entries.values()}

    # ---- layout and collectives ----------------------------------------------------------------------------------
    def layout(self) -> dict[str, int]:
        d = self.dims
        if d is None:
            return {"world_size": self.world_size, "dp": self.world_size, "dp_shard": self.world_size,
                    "dp_replicate": 1, "tp": 1, "pp": 1, "zero1": -1}
        return {"world_size": int(d.world_size), "dp": int(d.dp), "dp_shard": int(d.dp_shard),
                "dp_replicate": int(d.dp_replicate), "tp": int(d.tp), "pp": int(d.pp), "zero1": int(d.zero1)}

    @property
    def dp_rank(self) -> int:
        return int(self.dims.dp_rank) if self.dims is not None else self.rank

    def _all_gather(self, obj: Any) -> list:
        if self.group is None:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _broadcast(self, obj: Any) -> Any:
        """rank 0's `obj` on every rank."""
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _agree(self, ok: bool, error: str) -> tuple[bool, str]:
        """All ranks learn whether every rank succeeded, and what failed where."""
        res = self._all_gather((ok, error))
        bad = [f"rank {r}: {e}" for r, (o, e) in enumerate(res) if not o]
        return not bad, "; ".join(bad)

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def _dcp_kwargs(self) -> dict:
        if self.group is not None:
            return {"process_group": self.group}
        return {"no_dist": not (dist.is_available() and dist.is_initialized())}

    # ---- state dicts -----------------------------------------------------------------------------------------------
    def _model_state(self, with_optimizer: bool) -> tuple[dict, Optional[dict]]:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_state_dict)
        if self._model is None:
            raise CheckpointError("no model registered with the checkpoint manager")
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        if with_optimizer and self._optimizer is not None:
            return get_state_dict(self._model, self._optimizer, options=opts)
        return get_model_state_dict(self._model, options=opts), None

    def _collect(self) -> dict:
        """The whole state to save, as DCP sees it."""
        msd, osd = self._model_state(with_optimizer=True)
        state: dict[str, Any] = {"model": msd}
        if osd is not None:
            state["optimizer"] = osd
        for e in self._entries.values():
            sd = e.obj.state_dict()
            if e.scope == "global":
                state[e.name] = sd
            elif e.scope == "dp_rank":
                state[e.name] = {f"dp{self.dp_rank}": sd}
            else:
                state[e.name] = {f"rank{self.rank}": sd}
        return state

    def _per_dp_rank(self) -> dict[str, dict[str, Any]]:
        """{entry: {"dp0": state, "dp1": ...}} of every dp_rank-scoped entry, gathered to every rank (small)."""
        mine = {e.name: _jsonable(e.obj.state_dict()) for e in self._entries.values() if e.scope == "dp_rank"}
        if not mine:
            return {}
        out: dict[str, dict[str, Any]] = {name: {} for name in mine}
        for dp_rank, states in self._all_gather((self.dp_rank, mine)):
            for name, sd in states.items():
                out[name][f"dp{dp_rank}"] = sd
        return out

    def _meta(self, step: int, kind: str, reason: str, name: str, per_dp: dict) -> dict:
        summary: dict[str, Any] = {e.name: _jsonable(e.obj.state_dict()) for e in self._entries.values()
                                   if e.scope == "global"}
        data: dict[str, Any] = {}
        for entry, states in per_dp.items():
            values = list(states.values())
            data[entry] = {"per_dp_rank": states, "dp_ranks_agree": all(v == values[0] for v in values)}
        ts = summary.get("train_state", {})
        contents: dict[str, list[str]] = {c: [] for c in CONTENTS}
        contents["model"].append("model")
        if self._optimizer is not None:
            contents["optimizer"].append("optimizer")
        for e in self._entries.values():
            contents[e.content].append(e.name if e.scope == "global" else f"{e.name} (one per {e.scope})")
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION, "step": step, "kind": kind, "name": name,
            "reason": reason, "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "num_consumed_tokens": ts.get("num_consumed_tokens"), "step_count": ts.get("step_count"),
            "layout": self.layout(), "versions": library_versions(), "contents": contents,
            "state": summary, "data_state": data, "resume": RESUME_NOTES, "config": self.config_text,
        }

    # ---- saving ----------------------------------------------------------------------------------------------------
    def should_save(self, step: int) -> Optional[str]:
        """"regular" at multiples of checkpoint_every, else "snapshot" at multiples of oss_snapshot_freq, else None."""
        if not self.save_enabled or step <= 0:
            return None
        every = int(getattr(self.cfg, "checkpoint_every", 0) or 0)
        if every > 0 and step % every == 0:
            return "regular"
        snap = int(getattr(self.cfg, "oss_snapshot_freq", 0) or 0)
        if snap > 0 and step % snap == 0:
            return "snapshot"
        return None

    def _snapshot_slot(self) -> str:
        """The slot not holding the newest complete snapshot: at first read from the markers, then the other slot
        after each complete snapshot (a failed one is retried in the same slot, never over the good one)."""
        if self._next_slot is None:
            slot: Any = 0
            if self.rank == 0:
                try:
                    steps = []
                    for s in SNAPSHOT_SLOTS:
                        m = self.dest.read_marker(s)
                        steps.append(m["step"] if m else -1)
                    slot = 0 if steps[0] <= steps[1] else 1
                except Exception as e:
                    logger.warning("snapshot slots: cannot read their markers (%s); writing slot 0", e)
            self._next_slot = int(self._broadcast(slot))
        return SNAPSHOT_SLOTS[self._next_slot]

    def _write_dir(self, name: str) -> Path:
        if isinstance(self.dest, LocalDestination):
            return self.dest.path(name)
        return self.tmp_root / "upload" / name.replace("/", "_")

    def save(self, step: int, reason: str = "", kind: str = "regular") -> Optional[str]:
        """Save the registered state as checkpoint `step` (kind "regular" or "snapshot"); every rank calls it.

        Waits for the previous save first. Async (`async_upload`): returns once the state is copied to CPU memory.
        Sync: returns when the checkpoint is complete. Returns the checkpoint's URL (None when saving is off).
        A failed save is logged as an error on every rank (and alerted); it never removes an older checkpoint.
        """
        if not self.save_enabled:
            if not self._warned_disabled:
                self._warned_disabled = True
                logger.warning("checkpoint at step %d requested (%s) but saving is off (ckpt.enable_save_ckpt / "
                               "ckpt.save_ckpt_folder)", step, reason or kind)
            return None
        if kind not in ("regular", "snapshot"):
            raise ValueError(f"kind must be regular or snapshot, got {kind!r}")
        self.wait()
        t0 = time.perf_counter()
        name = str(step) if kind == "regular" else self._snapshot_slot()
        result = SaveResult(step, kind, name, self.dest.child(name), reason)
        write_dir = self._write_dir(name)
        self._prepare(write_dir, name)
        state = self._collect()
        per_dp = self._per_dp_rank()
        meta = self._meta(step, kind, reason, name, per_dp) if self.rank == 0 else None
        writer = InterruptibleWriter(write_dir, step)
        self.last_saved_step = step
        if self.async_save:
            if self._stager is None:  # kept: its CPU buffers are reused by the next save
                self._stager = ReusingCPUStager(pin_memory=torch.cuda.is_available())
            try:
                fut = dcp.async_save(state, storage_writer=writer, async_stager=self._stager, **self._dcp_kwargs())
            except _ERRORS as e:
                raise CheckpointError(f"checkpoint {result.url}: staging failed on rank {self.rank}: "
                                      f"{_describe(_unwrap(e))}") from e
            fut = getattr(fut, "upload_completion", fut)
            del state
            result.blocked_s = time.perf_counter() - t0
            self._thread = threading.Thread(target=self._finish, args=(fut, None, write_dir, meta, result, t0),
                                            name="internlm_core-checkpoint", daemon=True)
            self._thread.start()
            if self.rank == 0:
                logger.info("checkpoint %s (step %d, %s): training blocked %.3f s while staging; writing in the "
                            "background", result.url, step, reason or kind, result.blocked_s)
        else:
            err = ""
            try:
                dcp.save(state, storage_writer=writer, **self._dcp_kwargs())
            except _ERRORS as e:
                err = f"writing {write_dir}: {_describe(_unwrap(e))}"
            del state
            self._finish(None, err, write_dir, meta, result, t0)
            result.blocked_s = time.perf_counter() - t0
        return result.url

    def _prepare(self, write_dir: Path, name: str) -> None:
        """An empty folder to write into. An old checkpoint of the same name (a snapshot slot, or a step folder a
        crashed run left) loses its marker first, then is moved aside; the background thread deletes it."""
        err = ""
        try:
            if isinstance(self.dest, LocalDestination):
                if self.rank == 0 and write_dir.exists():
                    try:
                        (write_dir / MARKER).unlink()
                        fsync_dir(write_dir)
                    except FileNotFoundError:
                        pass
                    trash = write_dir.with_name(f"{_TRASH}{write_dir.name}-{os.getpid()}-{time.time_ns()}")
                    os.replace(write_dir, trash)
            elif self.local_rank == 0 and write_dir.exists():
                shutil.rmtree(write_dir, ignore_errors=True)
        except OSError as e:
            err = f"clearing {write_dir}: {e}"
        self._barrier()
        try:
            write_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            err = err or f"creating {write_dir}: {e}"
        ok, err = self._agree(not err, err)
        if not ok:
            raise CheckpointError(f"checkpoint {self.dest.child(name)}: {err}")

    def _my_files(self, write_dir: Path) -> dict[str, int]:
        """The files this rank is responsible for: its DCP shards; rank 0 also the index, meta and config."""
        files = {p.name: p.stat().st_size for p in write_dir.glob(f"__{self.rank}_*") if p.is_file()}
        if self.rank == 0:
            for fname in (DCP_METADATA, META, CONFIG):
                p = write_dir / fname
                files[fname] = p.stat().st_size
        return files

    def _finish(self, fut: Any, err: Optional[str], write_dir: Path, meta: Optional[dict], result: SaveResult,
                t0: float) -> None:
        """Everything after the shards are handed to DCP: on every rank, in the same order (collectives)."""
        ok, error = not err, err or ""
        try:
            if fut is not None:
                try:
                    fut.result()
                except _ERRORS as e:
                    ok, error = False, f"writing {write_dir}: {_describe(_unwrap(e))}"
            files: dict[str, int] = {}
            if ok:
                try:
                    if self.rank == 0:
                        write_durable(write_dir / META, json.dumps(meta, indent=1, default=str).encode())
                        write_durable(write_dir / CONFIG, self.config_text.encode())
                    files = self._my_files(write_dir)
                except OSError as e:
                    ok, error = False, f"{write_dir}: {e}"
            ok, error = self._agree(ok, error)
            remote = isinstance(self.dest, S3Destination)
            if ok and remote:
                ok, error = self._upload(write_dir, result.name, files)
            gathered = self._all_gather(files if ok else {})
            if self.rank == 0 and ok:
                all_files: dict[str, int] = {}
                for f in gathered:
                    all_files.update(f)
                marker = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": result.step,
                          "kind": result.kind, "name": result.name, "reason": result.reason,
                          "world_size": self.world_size, "time": meta["time"], "files": all_files}
                result.bytes = sum(all_files.values())
                try:
                    faults.maybe_kill("kill_before_marker", result.step)
                    text = json.dumps(marker, indent=1)
                    if remote:
                        self.dest.put_text(result.name, MARKER, text)
                    else:
                        fsync_dir(write_dir)
                        write_durable(write_dir / MARKER, text.encode())
                except Exception as e:
                    ok, error = False, f"writing the {MARKER} marker: {type(e).__name__}: {e}"
                if ok and result.kind == "regular":
                    self._retain(result.name)
            ok, error, nbytes = self._broadcast((ok, error, result.bytes))
            result.bytes = nbytes
            if ok and result.kind == "snapshot":
                self._next_slot = 1 - SNAPSHOT_SLOTS.index(result.name)
            if self.rank == 0 and isinstance(self.dest, LocalDestination):
                for parent in {write_dir.parent, self.dest.root}:
                    for trash in parent.glob(f"{_TRASH}*"):
                        shutil.rmtree(trash, ignore_errors=True)
            if ok and remote:
                self._barrier()
                if self.local_rank == 0:
                    shutil.rmtree(write_dir, ignore_errors=True)
        except _ERRORS as e:  # a peer died in a collective, or a bug: this save did not complete
            ok, error = False, _describe(_unwrap(e))
        result.ok, result.error = ok, error
        result.total_s = time.perf_counter() - t0
        self.last_result = result
        self.results.append(result)
        if ok:
            if self.rank == 0:
                logger.info("checkpoint %s complete: step %d, %.1f MB in %.2f s (training blocked %.3f s)",
                            result.url, result.step, result.bytes / 1e6, result.total_s, result.blocked_s)
        else:
            keep = f"; the local copy stays in {write_dir}" if isinstance(self.dest, S3Destination) else ""
            msg = (f"CHECKPOINT FAILED: step {result.step} at {result.url} did not complete: {error}{keep}. "
                   f"Older checkpoints are untouched; training goes on and the next save tries again.")
            logger.error(msg)
            if self.alerts is not None and self.rank == 0:
                try:
                    self.alerts.send(f"checkpoint of step {result.step} failed", msg, level="error")
                except Exception as e:
                    logger.error("alerting about the failed checkpoint failed too: %s", e)

    def _upload(self, write_dir: Path, name: str, files: dict[str, int]) -> tuple[bool, str]:
        """Rank 0 removes what the destination holds under `name`; then each rank uploads its own files."""
        ok, error = True, ""
        if self.rank == 0:
            try:
                self.dest.delete(name)
            except Exception as e:
                ok, error = False, f"clearing {self.dest.child(name)}: {e}"
        ok, error = self._agree(ok, error)
        if not ok:
            return ok, error
        try:
            for fname in sorted(files):
                self.dest.upload_file(write_dir / fname, name, fname)
        except Exception as e:
            ok, error = False, str(e)
        return self._agree(ok, error)

    def _retain(self, just_written: str) -> None:
        """keep_last_k: delete the oldest complete regular checkpoints beyond k; never the newest, never the one
        just written, never a snapshot slot, never an incomplete folder."""
        k = int(getattr(self.cfg, "keep_last_k", 0) or 0)
        if k <= 0:
            return
        try:
            done = [r for r in find_complete_checkpoints(self.dest) if r.name not in SNAPSHOT_SLOTS]
            done.sort(key=lambda r: r.step, reverse=True)
            keep = {r.name for r in done[:k]} | {just_written}
            for r in done:
                if r.name not in keep:
                    self.dest.delete(r.name)
                    logger.info("keep_last_k=%d: removed checkpoint %s", k, r.url)
        except Exception as e:
            logger.warning("keep_last_k: cleaning up old checkpoints failed: %s", e)

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

    # ---- loading ---------------------------------------------------------------------------------------------------
    def _rank0(self, fn: Callable[[], Any]) -> Any:
        """fn() on rank 0, its value (or its CheckpointError) on every rank."""
        value: Any = None
        if self.rank == 0:
            try:
                value = ("ok", fn())
            except Exception as e:
                value = ("error", str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}")
        status, payload = self._broadcast(value)
        if status == "error":
            raise CheckpointError(payload)
        return payload

    def find_latest(self, dest: Optional[Destination] = None) -> Optional[CheckpointRef]:
        """The newest complete checkpoint under `dest` (default: save_ckpt_folder), the same on every rank."""
        dest = dest or self.dest
        if dest is None:
            return None
        found = self._rank0(lambda: (lambda r: (r.name, r.marker) if r else None)(latest_checkpoint(dest)))
        return CheckpointRef(dest, found[0], found[1]) if found else None

    def resume(self) -> Optional[LoadResult]:
        """At start: the newest complete checkpoint under save_ckpt_folder when auto_resume (everything),
        else `load_ckpt_info` (its content), else nothing."""
        if getattr(self.cfg, "auto_resume", False) and self.dest is not None:
            ref = self.find_latest()
            if ref is not None:
                res = self._load_ref(ref, CONTENTS)
                self.last_saved_step = ref.step
                return res
            if self.rank == 0:
                logger.info("auto_resume: no complete checkpoint under %s", self.dest.url)
        info = getattr(self.cfg, "load_ckpt_info", None)
        if info is not None and getattr(info, "path", None):
            return self.load(info.path, info.content, getattr(info, "ckpt_type", "internlm_core"))
        return None

    def load(self, path: str, content: Iterable[str] | str | None = ("all",),
             ckpt_type: str = "internlm_core") -> LoadResult:
        """Load a checkpoint folder (or the newest complete one under a folder of them) into the registered state."""
        parts = normalize_content(content)
        if ckpt_type != "internlm_core":
            return self._load_external(str(path), parts, ckpt_type)
        dest = parse_destination(path, self.attempts, self.backoff_s)

        def resolve() -> tuple[str, dict]:
            marker = dest.read_marker("")
            if marker is not None:
                problem = dest.verify("", marker)
                if problem:
                    raise CheckpointError(f"checkpoint {dest.url} is damaged: {problem}")
                return "", marker
            if DCP_METADATA in dest.file_sizes("") or (isinstance(dest, LocalDestination)
                                                       and any(dest.root.glob("__*_*.distcp"))):
                raise CheckpointError(f"checkpoint {dest.url} is incomplete (no {MARKER} marker): it was "
                                      "interrupted while being written; load an older one")
            ref = latest_checkpoint(dest)
            if ref is None:
                raise CheckpointError(f"{dest.url}: no complete checkpoint there (ckpt.load_ckpt_info.path)")
            return ref.name, ref.marker

        name, marker = self._rank0(resolve)
        return self._load_ref(CheckpointRef(dest, name, marker), parts)

    def _load_external(self, path: str, parts: tuple[str, ...], ckpt_type: str) -> LoadResult:
        fn = _MODEL_LOADERS.get(ckpt_type)
        if fn is None and ckpt_type in _BUILTIN_LOADERS:
            module, attr = _BUILTIN_LOADERS[ckpt_type]
            try:
                fn = getattr(importlib.import_module(f"{__package__}.{module}"), attr, None)
            except ModuleNotFoundError as e:
                if e.name != f"{__package__}.{module}":
                    raise
        if fn is None:
            raise CheckpointError(f"ckpt.load_ckpt_info.ckpt_type: no loader for {ckpt_type!r} in this build "
                                  f"(available: internlm_core{''.join(', ' + k for k in sorted({*_MODEL_LOADERS, *_BUILTIN_LOADERS}))})")
        if parts != ("model",) and self.rank == 0:
            logger.warning("load_ckpt_info: a %s checkpoint holds a model only; loading the model, the optimizer "
                           "and schedules start fresh", ckpt_type)
        if self._model is None:
            raise CheckpointError("no model registered with the checkpoint manager")
        fn(self._model, path)
        self.loaded = LoadResult(path, 0, ("model",), True)
        return self.loaded

    def _local_copy(self, ref: CheckpointRef) -> tuple[Path, Callable[[], None]]:
        """A local folder holding the checkpoint (downloaded from object storage by each node's local rank 0)."""
        if isinstance(ref.dest, LocalDestination):
            return ref.dest.path(ref.name), lambda: None
        folder = self.tmp_root / "download" / f"{(ref.name or 'root').replace('/', '_')}-step{ref.step}"
        ok, error = True, ""
        if self.local_rank == 0:
            try:
                t0 = time.perf_counter()
                ref.dest.download(ref.name, ref.marker.get("files", {}), folder)
                logger.info("downloaded %s to %s in %.1f s", ref.url, folder, time.perf_counter() - t0)
            except Exception as e:
                ok, error = False, str(e)
        ok, error = self._agree(ok, error)
        if not ok:
            raise CheckpointError(f"checkpoint {ref.url}: download failed: {error}")

        def cleanup() -> None:
            self._barrier()
            if self.local_rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
        return folder, cleanup

    def _load_ref(self, ref: CheckpointRef, parts: tuple[str, ...]) -> LoadResult:
        t0 = time.perf_counter()
        folder, cleanup = self._local_copy(ref)
        try:
            md = read_dcp_metadata(folder)
            saved: dict = {}
            try:
                saved = json.loads((folder / META).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                pass
            request, apply, notes = self._request(parts, md, ref, saved.get("layout", {}))
            try:
                dcp.load(request, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner(),
                         **self._dcp_kwargs())
            except CheckpointError:
                raise
            except _ERRORS as e:
                inner = _unwrap(e)
                if isinstance(inner, CheckpointError):
                    raise inner from None
                raise CheckpointError(f"checkpoint {ref.url}: loading failed on rank {self.rank}: "
                                      f"{_describe(inner)}") from e
            apply(request)
        finally:
            cleanup()
        same = saved.get("layout") == self.layout()
        res = LoadResult(ref.url, ref.step, parts, same, saved.get("layout", {}), notes)
        self.loaded = res
        if self.rank == 0:
            how = ("same layout: exact resume" if same else
                   f"layout changed from {saved.get('layout')} to {self.layout()}: model, optimizer and schedules "
                   "exact; data position and RNG as described in the checkpoint's meta.json")
            logger.info("loaded %s (step %d, %s; content %s) in %.2f s; %s%s", ref.url, ref.step, ref.kind,
                        ",".join(parts), time.perf_counter() - t0, how,
                        "".join(f"; {n}" for n in notes))
        return res

    def _request(self, parts: tuple[str, ...], md: Any, ref: CheckpointRef, saved_layout: dict
                 ) -> tuple[dict, Callable[[dict], None], list[str]]:
        """The state dict DCP fills (templates of the right shapes), checked against the checkpoint's index,
        and the function that hands the loaded values to their owners."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)
        index = md.state_dict_metadata
        request: dict[str, Any] = {}
        notes: list[str] = []
        want_model, want_optim = "model" in parts, "optimizer" in parts and self._optimizer is not None
        if want_model or want_optim:
            msd, osd = self._model_state(with_optimizer=want_optim)
            if want_model:
                self._check_model(msd, index, ref.url)
                request["model"] = msd
            if want_optim:
                request["optimizer"] = osd
        sources: dict[str, str] = {}
        for e in self._entries.values():
            if e.content not in parts:
                continue
            template = e.obj.state_dict()
            if e.scope == "global":
                key = e.name
            else:
                unit, mine = ("dp", self.dp_rank) if e.scope == "dp_rank" else ("rank", self.rank)
                saved_ids = sorted({int(m.group(1)) for k in index
                                    if (m := re.match(rf"^{re.escape(e.name)}\.{unit}(\d+)\.", k))})
                if not saved_ids:
                    if e.strict:
                        raise CheckpointError(f"checkpoint {ref.url} has no '{e.name}' state (saved by another "
                                              "version?)")
                    continue
                src = mine if mine in saved_ids else saved_ids[mine % len(saved_ids)]
                if src != mine:
                    notes.append(f"{e.name}: {unit} rank {mine} takes the state saved by {unit} rank {src}")
                key = f"{e.name}.{unit}{src}"
                template = {f"{unit}{src}": template}
            if not e.strict:
                template = _only_present(template, key if e.scope == "global" else e.name, index)
                if template is _MISSING:
                    continue
            request[e.name] = template
            sources[e.name] = key
        self._check_entries(request, index, ref.url)
        opts = StateDictOptions(flatten_optimizer_state_dict=True)

        def apply(loaded: dict) -> None:
            if want_model:
                set_model_state_dict(self._model, loaded["model"], options=opts)
            if want_optim:
                set_optimizer_state_dict(self._model, self._optimizer, loaded["optimizer"], options=opts)
            for name, key in sources.items():
                e = self._entries[name]
                value = loaded[name]
                if e.scope != "global":
                    value = value[key.split(".", 1)[1]]
                e.obj.load_state_dict(value)
            if want_optim and "scheduler" not in parts:
                for e in self._entries.values():  # the loaded param_groups carry the old lr/betas: fresh schedule
                    if e.content == "scheduler":
                        e.obj.load_state_dict(e.obj.state_dict())
        return request, apply, notes

    def _check_model(self, msd: dict, index: dict, url: str) -> None:
        """Every parameter of the model (all ranks together) is in the checkpoint with its shape, and nothing else."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        mine = {k: tuple(v.shape) for k, v in msd.items() if isinstance(v, torch.Tensor)}
        model: dict[str, tuple] = {}
        for d in self._all_gather(mine):
            model.update(d)
        saved = {k[len("model."):]: m for k, m in index.items() if k.startswith("model.")}
        problems = []
        for k in sorted(model):
            m = saved.get(k)
            if m is None:
                problems.append(f"parameter '{k}' (shape {_shape(model[k])}) is missing from the checkpoint")
            elif isinstance(m, TensorStorageMetadata) and tuple(m.size) != model[k]:
                problems.append(f"parameter '{k}' has shape {_shape(tuple(m.size))} in the checkpoint but "
                                f"{_shape(model[k])} in the model")
        for k in sorted(set(saved) - set(model)):
            problems.append(f"parameter '{k}' is in the checkpoint but not in the model")
        if problems:
            more = f"; and {len(problems) - 6} more" if len(problems) > 6 else ""
            raise CheckpointError(f"checkpoint {url} does not match the model: {'; '.join(problems[:6])}{more}")

    def _check_entries(self, request: dict, index: dict, url: str) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        problems = []
        for k, v in flat_keys({n: s for n, s in request.items() if n != "model"}).items():
            m = index.get(k)
            if m is None:
                problems.append(f"'{k}' is missing from the checkpoint")
            elif isinstance(v, torch.Tensor) and isinstance(m, TensorStorageMetadata) and tuple(m.size) != tuple(v.shape):
                problems.append(f"'{k}' has shape {_shape(tuple(m.size))} in the checkpoint but {_shape(tuple(v.shape))} here")
            elif isinstance(v, torch.Tensor) != isinstance(m, TensorStorageMetadata):
                problems.append(f"'{k}' is {'a tensor' if isinstance(m, TensorStorageMetadata) else 'not a tensor'} "
                                "in the checkpoint")
        if problems:
            more = f"; and {len(problems) - 6} more" if len(problems) > 6 else ""
            raise CheckpointError(f"checkpoint {url} does not match this run's state: "
                                  f"{'; '.join(problems[:6])}{more}")


_TRASH = ".trash-"  # replaced checkpoint folders, deleted in the background

# DCP raises CheckpointException, a BaseException: catch it with the ordinary ones
_ERRORS = (Exception, CheckpointException)


def _unwrap(e: BaseException) -> BaseException:
    """The first rank's underlying error of a DCP CheckpointException (ours if one of ours is there)."""
    if isinstance(e, CheckpointException):
        inner = [v[0] if isinstance(v, tuple) else v for v in e.failures.values()]
        ours = [x for x in inner if isinstance(x, CheckpointError)]
        if ours or inner:
            return (ours or inner)[0]
    return e


def _describe(e: BaseException) -> str:
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


def _jsonable(value: Any) -> Any:
    """A state dict as JSON can hold it (tensors and other objects as their text)."""
    return json.loads(json.dumps(value, default=str))


def _shape(shape: tuple) -> str:
    return str(tuple(int(s) for s in shape))


def _only_present(template: Any, prefix: str, index: dict) -> Any:
    """`template` without the leaves the checkpoint does not hold (DCP's flattened names)."""
    if isinstance(template, dict):
        out = {}
        for k, v in template.items():
            sub = _only_present(v, f"{prefix}.{k}", index)
            if sub is not _MISSING:
                out[k] = sub
        return out if out else _MISSING
    return template if prefix in index else _MISSING


_MISSING: Any = object()
