"""`ckpt.hf_export_every`: a Hugging Face folder (safetensors, config.json, generation_config.json, tokenizer files)
written as the run goes, beside the DCP checkpoints: `<save_ckpt_folder>/hf/<step>/`, loadable by `transformers`
as it is (`AutoModelForCausalLM.from_pretrained`).

In the training thread, every rank gathers the model one layer group at a time (`full_tensor` of each DTensor: FSDP
and tensor-parallel shards alike) and keeps, as CPU copies in the export dtype, only the tensors of the safetensors
shards it writes: the shards are planned once (one per rank, of about equal bytes; more where a share would exceed
HF's 5GB) and dealt out to the ranks in turn, so no rank holds the whole model. The writing then runs in a
background thread on the export's own gloo group, as a DCP save does: each rank writes and fsyncs its shards and
checksums them; rank 0 adds config.json, generation_config.json, the tokenizer files and
`model.safetensors.index.json` (HF's sharded format, when there is more than one shard); the files reach the storage
(in place, or staged and uploaded by each rank); rank 0 writes the COMPLETE marker last, listing every file with its
size and crc32 (the DCP checkpoints' rules). Nothing is deleted: every export is kept. Not with pipeline parallel (a
stage holds only its own layers): export a checkpoint with tools/convert2hf.py instead.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import ConfigError
from ..utils.logging import get_logger
from .collectives import Collectives
from .foreign import context, groups
from .hf import DTYPES, export_adapter, model_shapes
from .integrity import checksums
from .meta import build_marker
from .storage import MARKER, Storage, write_durable
from .tokenizer_export import write_tokenizer_files
from .writer import write_target

logger = get_logger(__name__)
_HF_MAX_SHARD = 5 * 10**9  # transformers' default max_shard_size


def export_name(step: int) -> str:
    """The storage name of the export of `step`."""
    return f"hf/{step}"


class ShardPlan:
    """Which HF tensor goes into which safetensors file, and which rank writes it (the same on every rank)."""

    def __init__(self, cfg: Any, world_size: int, rank: int):
        from ..model import model_args_from_config

        self.adapter = export_adapter(cfg)
        self.dtype_name = _export_dtype(cfg)
        self.dtype = DTYPES[self.dtype_name]
        self.ctx = context(model_args_from_config(cfg))
        shapes = model_shapes(cfg)
        self.groups = groups(shapes)  # our names by layer group, in state-dict order
        self.owner: dict[str, str] = {}   # HF name → the group that produces it (a tied output produces nothing new)
        nbytes: dict[str, int] = {}
        size = torch.empty((), dtype=self.dtype).element_size()
        for key, names in self.groups.items():
            for f, t in self.adapter.to_foreign({n: shapes[n] for n in names}, self.ctx).items():
                if f not in self.owner:
                    self.owner[f], nbytes[f] = key, t.numel() * size
        self.total = sum(nbytes.values())
        shards = balanced_shards([(f, nbytes[f]) for f in self.owner],
                                 max(world_size, math.ceil(self.total / _HF_MAX_SHARD)))
        self.files = (["model.safetensors"] if len(shards) == 1 else
                      [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
        self.file_of = {f: self.files[i] for i, names in enumerate(shards) for f in names}
        self.mine = {fname for i, fname in enumerate(self.files) if i % world_size == rank}

    def index(self) -> dict:
        """model.safetensors.index.json."""
        return {"metadata": {"total_size": self.total}, "weight_map": dict(self.file_of)}


def balanced_shards(sizes: list[tuple[str, int]], n: int) -> list[list[str]]:
    """Names (in order) cut into at most `n` contiguous shards of about equal bytes: a tensor goes to the shard its
    first byte falls in (one larger than a share leaves the next shard smaller, or empty and dropped)."""
    total = max(1, sum(b for _, b in sizes))
    shards: list[list[str]] = [[] for _ in range(n)]
    offset = 0
    for name, nbytes in sizes:
        shards[min(n - 1, offset * n // total)].append(name)
        offset += nbytes
    return [s for s in shards if s]


def _export_dtype(cfg: Any) -> str:
    from ..numerics.precision import resolve_precision

    return resolve_precision(cfg.model.dtype, "cpu").export_name


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective on the tensor's mesh for a DTensor: every rank calls it, in the same order)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class HFExporter:
    """Writes `<save_ckpt_folder>/hf/<step>/` every `hf_export_every` steps (see the module docstring).

    cfg: the run's Config (the family's adapter and config.json come from it). model: the parallelized model.
    dest: the checkpoints' storage; tmp_root: where staged exports wait for their upload. The trainer's loop calls
    `maybe_export` after its save decision of each step (no export while the loss is unhealthy, as no checkpoint is
    saved then) and `wait` at the end.
    """

    def __init__(self, cfg: Any, model: torch.nn.Module, dest: Storage, *, rank: int, world_size: int,
                 local_rank: int, tmp_root: Path, alerts: Any = None):
        self.cfg, self.model, self.dest, self.tmp_root = cfg, model, dest, Path(tmp_root)
        self.every = int(cfg.ckpt.hf_export_every)
        self.alerts = alerts
        self.coll = Collectives(rank, world_size, local_rank)  # its own gloo group: the DCP writer uses the other
        self.plan = ShardPlan(cfg, self.coll.world_size, self.coll.rank)
        self._thread: Optional[threading.Thread] = None
        self.results: list[tuple[int, bool, str]] = []  # (step, complete, error) of every export

    # ---- the loop's calls -------------------------------------------------------------------------------------
    def maybe_export(self, step: int, unhealthy: Optional[str] = None) -> None:
        """Export `step` when it is a multiple of `hf_export_every`, unless the loss is unhealthy (`unhealthy`:
        why, as the checkpointer's veto)."""
        if step % self.every:
            return
        why = unhealthy
        if why is not None:
            if self.coll.rank == 0:
                logger.warning("Hugging Face export at step %d skipped: %s", step, why)
            return
        self.export(step)

    # ---- one export ------------------------------------------------------------------------------------------
    def export(self, step: int) -> None:
        """Gather and copy this rank's shards (training blocks), then write them in the background."""
        self.wait()
        t0 = time.perf_counter()
        target = write_target(self.dest, export_name(step), self.tmp_root)
        target.prepare(self.coll)
        mine = self._collect()
        blocked = time.perf_counter() - t0
        self._thread = threading.Thread(target=self._write, args=(step, target, mine, t0, blocked),
                                        name="internlm_core-hf-export", daemon=True)
        self._thread.start()

    def _collect(self) -> dict[str, dict[str, torch.Tensor]]:
        """{file: {HF name: CPU copy}} of the shards this rank writes, the model gathered one group at a time."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        sd = get_model_state_dict(self.model)
        p = self.plan
        mine: dict[str, dict[str, torch.Tensor]] = {f: {} for f in p.mine}
        for key, names in p.groups.items():
            full = {n: _full(sd[n].detach()) for n in names}  # every rank: the gathers are collectives
            wanted = [f for f, k in p.owner.items() if k == key and p.file_of[f] in p.mine]
            if not wanted:
                continue
            foreign = p.adapter.to_foreign(full, p.ctx)
            for f in wanted:  # copies: the optimizer changes the parameters while the thread writes
                mine[p.file_of[f]][f] = foreign[f].to(device="cpu", dtype=p.dtype, copy=True).contiguous()
        return mine

    def _write_files(self, folder: Path, mine: dict[str, dict[str, torch.Tensor]]) -> dict[str, int]:
        """This rank's files in `folder`, durable: its shards; rank 0 also the config, tokenizer and index."""
        from safetensors.torch import save_file

        written: list[str] = []
        for fname, tensors in sorted(mine.items()):
            save_file(tensors, str(folder / fname), metadata={"format": "pt"})
            _fsync(folder / fname)
            written.append(fname)
        if self.coll.rank == 0:
            cfg, p = self.cfg, self.plan
            tok = write_tokenizer_files(cfg.tokenizer, folder, cfg.data.seq_len)
            conf = p.adapter.foreign_config(cfg.model_inputs(), p.dtype_name, tok.special_ids)  # type: ignore[misc]
            gen = {"_from_model_config": True, **{k: v for k, v in tok.special_ids.items() if v is not None}}
            texts = {"config.json": conf, "generation_config.json": gen}
            if len(p.files) > 1:
                texts["model.safetensors.index.json"] = p.index()
            for fname, obj in texts.items():
                write_durable(folder / fname, (json.dumps(obj, indent=2) + "\n").encode())
            written += list(texts) + [Path(f).name for f in tok.files]
        return {f: (folder / f).stat().st_size for f in written}

    def _write(self, step: int, target: Any, mine: dict, t0: float, blocked: float) -> None:
        """The background part, on every rank in the same order (collectives on the export's group)."""
        coll = self.coll
        files: dict[str, int] = {}
        sums: dict[str, str] = {}
        ok, error = True, ""
        try:
            files = self._write_files(target.folder, mine)
            sums = checksums(target.folder, files)
        except Exception as e:  # noqa: BLE001 - reported below on every rank; training goes on
            ok, error = False, f"{type(e).__name__}: {e}"
        del mine
        ok, error = coll.agree(ok, error)
        if ok:
            ok, error = target.publish(files, coll)
        gathered = coll.all_gather((files, sums) if ok else ({}, {}))
        if coll.rank == 0 and ok:
            ok, error = self._commit(step, gathered)
        ok, error = coll.broadcast((ok, error))
        target.cleanup(ok, coll)
        self.results.append((step, ok, error))
        self._report(step, ok, error, time.perf_counter() - t0, blocked)

    def _commit(self, step: int, gathered: list) -> tuple[bool, str]:
        """Rank 0: the COMPLETE marker, last, listing every rank's files with their sizes and crc32."""
        files: dict[str, int] = {}
        sums: dict[str, str] = {}
        for f, c in gathered:
            files.update(f)
            sums.update(c)
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        marker = build_marker(step=step, kind="hf", name=export_name(step), reason="hf_export_every",
                              world_size=self.coll.world_size, time=now, files=files, checksums=sums)
        try:
            self.dest.put_text(export_name(step), MARKER, json.dumps(marker, indent=1))
        except Exception as e:  # noqa: BLE001
            return False, f"writing the {MARKER} marker: {type(e).__name__}: {e}"
        return True, ""

    def _report(self, step: int, ok: bool, error: str, total_s: float, blocked_s: float) -> None:
        url = self.dest.child(export_name(step))
        if ok:
            if self.coll.rank == 0:
                logger.info("Hugging Face export %s complete: step %d, %d file(s) in %.2f s (training blocked "
                            "%.3f s)", url, step, len(self.plan.files), total_s, blocked_s)
            return
        msg = (f"HUGGING FACE EXPORT FAILED: step {step} at {url}: {error}; training goes on, the next export tries "
               "again")
        logger.error(msg)
        if self.alerts is not None and self.coll.rank == 0:
            try:
                self.alerts.send(f"Hugging Face export of step {step} failed", msg, level="error")
            except Exception as e:  # noqa: BLE001
                logger.error("alerting about the failed export failed too: %s", e)

    def wait(self) -> None:
        """Block until the last export has completed (or failed)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def build_hf_exporter(cfg: Any, model: torch.nn.Module, manager: Any) -> Optional[HFExporter]:
    """The exporter of `ckpt.hf_export_every` (None when 0); ConfigError for what it cannot do."""
    every = int(cfg.ckpt.hf_export_every)
    if every <= 0:
        return None
    if manager.dest is None or not cfg.ckpt.enable_save_ckpt:
        raise ConfigError("ckpt.hf_export_every: needs ckpt.enable_save_ckpt=True and ckpt.save_ckpt_folder (the "
                          "exports go to <save_ckpt_folder>/hf/<step>/)")
    if cfg.parallel.pipeline > 1:
        raise ConfigError("ckpt.hf_export_every: not with parallel.pipeline > 1 (a stage holds only its layers); "
                          "export a checkpoint with tools/convert2hf.py")
    return HFExporter(cfg, model, manager.dest, rank=manager.rank, world_size=manager.world_size,
                      local_rank=manager.local_rank, tmp_root=manager.tmp_root / "hf", alerts=manager.alerts)
