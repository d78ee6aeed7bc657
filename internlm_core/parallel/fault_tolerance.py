"""Replica groups that survive the loss of a group: the torchft adapter (`parallel.fault_tolerance`).

Each replica group is its own torchrun job holding the whole model (FSDP, tensor or pipeline parallel inside it);
the groups train the same weights, each on its own share of every global batch. Every step:

1. `begin_step`: torchft's Manager asks the lighthouse for a quorum (the live groups). A group that is behind (it
   just started, or failed to commit a step its peers committed) receives the state of a live peer's rank of the
   same group rank over HTTP, here, before the step: the same things a checkpoint holds (`HealState`).
2. `average_gradients`: after the backward, the gradients (this rank's shards) are averaged over the groups of the
   quorum by torchft's fault-tolerant all-reduce (utils/collectives.replica_all_reduce); a lost peer fails it.
3. `commit`: every rank of the group votes; the optimizer steps only when the whole group says yes. A step that
   is not committed is trained again by the loop (same batch), after a new quorum without the lost group.

The loop sees the small `ReplicaGroups` protocol only; torchft is imported when the section is enabled.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..config.schema import FaultToleranceConfig
from ..errors import ConfigError, TrainingError
from ..utils import collectives
from ..utils.accelerators import bind_thread_device
from ..utils.logging import get_logger

logger = get_logger(__name__)

# gradients are averaged in flat buckets of at most this many bytes: one collective per bucket instead of one per
# tensor, without a second copy of every gradient at once
BUCKET_BYTES = 64 << 20
# the keys torchft's Manager keeps in the group's store: stale ones from a group that died before would point a
# restarted rank at a dead manager
_MANAGER_KEYS = ("manager_addr", "replica_id")


class ReplicaGroups(Protocol):
    """The loop's view of the replica groups (None when `parallel.fault_tolerance` is off)."""

    replica_id: int
    group_size: int    # replica groups of the job (parallel.fault_tolerance.group_size)
    participants: int  # replica groups in this step's quorum
    error: Optional[str]  # why the last step was not committed (None: it was)

    def begin_step(self) -> bool:
        """Join this step's quorum; True when this group was behind and took a live peer's state."""

    def average_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """Average the gradients of `params` over the groups of the quorum, in place."""

    def commit(self) -> bool:
        """The group's vote after the backward: True when the optimizer may step."""

    def step_metrics(self) -> dict[str, float]:
        """`ft/...` values of the last step, for metrics.jsonl."""

    def close(self) -> None:
        """Leave the quorum (the end of training)."""


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


class HealState:
    """What a group that rejoins receives from a live peer: the model and optimizer as this rank's local shards
    (the groups share one layout, so rank r's shards are rank r's everywhere) and every other registered Stateful
    (`statefuls`: what the checkpoint manager registered, by name). `healed` counts the heals received."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, statefuls: Mapping[str, Any]):
        self.model, self.optimizer = model, optimizer
        self.statefuls = {name: obj for name, obj in statefuls.items() if obj is not None}
        self.healed = 0

    def state_dict(self) -> dict:
        """Sent by a live peer (torchft's HTTP transport). No copies: the peer's optimizer does not step before the
        transfer ended (torchft holds the step until it has)."""
        optim = self.optimizer.state_dict()
        sharded = sorted([i, k] for i, s in optim["state"].items() for k, v in s.items() if isinstance(v, DTensor))
        return {"model": {k: _local(v) for k, v in self.model.state_dict().items()},
                "optimizer": {"state": {i: {k: _local(v) for k, v in s.items()} for i, s in optim["state"].items()},
                              "param_groups": optim["param_groups"], "sharded": sharded},
                "statefuls": {name: obj.state_dict() for name, obj in self.statefuls.items()}}

    def load_state_dict(self, sd: dict) -> None:
        """Take a live peer's state: model shards copied in place, the optimizer's state rebuilt on this rank's
        parameters (a fresh group has none yet), then every Stateful."""
        with torch.no_grad():
            for name, value in self.model.state_dict().items():
                _local(value).copy_(sd["model"][name])
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        sharded = {(int(i), k) for i, k in sd["optimizer"]["sharded"]}
        state = {}
        for i, s in sd["optimizer"]["state"].items():
            p = params[int(i)]
            state[i] = {k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                        if (int(i), k) in sharded else v for k, v in s.items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": sd["optimizer"]["param_groups"]})
        for name, obj in self.statefuls.items():
            if name in sd["statefuls"]:
                obj.load_state_dict(sd["statefuls"][name])
        self.healed += 1


class TorchFTReplicas:
    """`ReplicaGroups` over torchft's Manager with a synchronous quorum (a heal is applied before the step)."""

    def __init__(self, manager: Any, ft: FaultToleranceConfig, heal: HealState, lighthouse: str,
                 store: Optional[dist.TCPStore] = None, device: torch.device = torch.device("cpu")):
        self.manager, self.heal = manager, heal
        self.replica_id, self.group_size, self.quorum_timeout = ft.replica_id, ft.group_size, ft.quorum_timeout
        self.lighthouse = lighthouse
        self.store = store  # the store this rank hosts for its group (a group of one process), open while it trains
        self.participants = 0
        self.error: Optional[str] = None  # why the last step was not committed
        self._quorum_s = self._reduce_s = self._commit_s = 0.0
        self._sigterm = _LeaveOnSigterm(self.replica_id, device)

    def begin_step(self) -> bool:
        healed = self.heal.healed
        t0 = time.perf_counter()
        try:
            self._sigterm.wait(self.manager.start_quorum, "its quorum")
        except TrainingError:
            raise
        except Exception as e:  # noqa: BLE001 - torchft raises the RPC's own errors; say what they mean here
            raise TrainingError(f"replica group {self.replica_id}: the step's quorum failed (lighthouse "
                                f"{self.lighthouse}, parallel.fault_tolerance.quorum_timeout "
                                f"{self.quorum_timeout:.0f} s): {type(e).__name__}: {e}") from None
        self._quorum_s = time.perf_counter() - t0
        self.participants = self.manager.num_participants()
        if self.heal.healed != healed:  # the loop logs the steps it went from and to (trainer/replicated.py)
            logger.info(f"replica group {self.replica_id}: the heal took {self._quorum_s:.2f} s (torchft step "
                        f"{self.manager.current_step()})")
        return self.heal.healed != healed

    def average_gradients(self, params: Iterable[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        grads = [_local(p.grad) for p in params if p.grad is not None]
        for bucket in _buckets(grads, BUCKET_BYTES):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            if not collectives.replica_all_reduce(self.manager, flat):
                break  # the manager records the failure; the group votes not to commit
            offset = 0
            for g in bucket:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self._reduce_s = time.perf_counter() - t0

    def commit(self) -> bool:
        t0 = time.perf_counter()
        try:
            committed = bool(self._sigterm.wait(self.manager.should_commit, "its commit vote"))
        except RuntimeError as e:
            if "max_retries" not in str(e):
                raise
            # torchft: more consecutive uncommitted steps than max_retries
            raise TrainingError(f"replica group {self.replica_id}: {e} "
                                f"(parallel.fault_tolerance.max_retries)") from None
        self.error = None if committed else str(self.manager.errored() or "a peer group voted no")
        self._commit_s = time.perf_counter() - t0
        return committed

    def step_metrics(self) -> dict[str, float]:
        # seconds of this step in the quorum, the all-reduce across groups (waiting for the slowest group
        # included) and the commit vote: what fault tolerance costs a step
        return {"ft/participants": self.participants, "ft/quorum_time": self._quorum_s,
                "ft/reduce_time": self._reduce_s, "ft/commit_time": self._commit_s,
                "ft/replica_id": self.replica_id, "ft/heals": self.heal.healed}

    def close(self) -> None:
        self.manager.shutdown(wait=False)


class _LeaveOnSigterm:
    """A SIGTERM makes this rank leave at its next wait on torchft (the step's quorum, the group's vote), or at once
    when it comes during one (TrainingError), instead of at the end of the step as the stop controller would have
    it. The SIGTERM comes from the agent stopping a group that lost a rank (torchrun, then SIGKILL 30 s later); a
    rank that waited on would keep its group's heartbeat alive, and torchft forms no quorum without more than half
    of the heartbeating groups: with two groups the live one would wait for it. The previous handler (the stop
    controller's) still runs. The wait runs `fn` in a daemon thread: a call blocked in torchft's Rust client does
    not come back to Python for a signal handler, the waiting main thread does. That thread first makes the rank's
    `device` its current device (a new CUDA thread is on GPU 0): torchft's start_quorum hands the caller's current
    device to the thread that connects the replica communicator, and should_commit synchronizes its stream."""

    def __init__(self, replica_id: int, device: torch.device = torch.device("cpu")):
        self.replica_id, self.received, self.device = replica_id, False, device
        self.waiting_for: Optional[str] = None
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.received = True
        if callable(self._previous):
            self._previous(signum, frame)
        if self.waiting_for is not None:
            raise self._error()

    def _error(self) -> TrainingError:
        return TrainingError(f"replica group {self.replica_id}: SIGTERM (its agent stops it) while waiting for "
                             f"{self.waiting_for}; leaving at once")

    def wait(self, fn: Callable[[], Any], what: str) -> Any:
        """fn(), waited for so that a SIGTERM ends it; called with the rank's device current."""
        if threading.current_thread() is not threading.main_thread():
            bind_thread_device(self.device)
            return fn()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                bind_thread_device(self.device)
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread as it is
                box["error"] = e

        worker = threading.Thread(target=run, name="torchft_wait", daemon=True)
        self.waiting_for = what
        try:
            worker.start()
            while worker.is_alive():
                if self.received:
                    raise self._error()
                worker.join(0.05)
        finally:
            self.waiting_for = None
        if "error" in box:
            raise box["error"]
        return box["value"]


def _buckets(tensors: list[torch.Tensor], max_bytes: int) -> Iterable[list[torch.Tensor]]:
    """Consecutive runs of `tensors` of one dtype and device, each at most `max_bytes` (or one larger tensor)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > max_bytes or t.dtype != bucket[0].dtype or t.device != bucket[0].device):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def _group_store(rank: int, world_size: int) -> tuple[str, int, Optional[dist.TCPStore]]:
    """(address, port, store held open) of the TCPStore torchft's Manager meets its group in: the launcher's at
    MASTER_ADDR:MASTER_PORT (torchrun's agent store, or rank 0's that formed the process group), from which rank 0
    first removes the keys a Manager of an earlier group (one torchrun restarted) left, before any rank reads them;
    a group of one process without an agent has no store: it hosts its own (the other groups reach it there)."""
    if world_size == 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        host = socket.gethostname()
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        return host, store.port, store
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise ConfigError(f"parallel.fault_tolerance: rank {rank} of {world_size} has no MASTER_ADDR/MASTER_PORT "
                          f"(expected a torchrun or SLURM launch)")
    if rank == 0:
        client = dist.TCPStore(addr, int(port), is_master=False, wait_for_workers=False)
        for key in _MANAGER_KEYS:
            client.delete_key(key)
    if world_size > 1 and collectives.dist_ready():
        collectives.barrier()
    return addr, int(port), None


def build_replica_groups(ft: FaultToleranceConfig, rank: int, world_size: int, device: torch.device,
                         heal: HealState, step: int) -> Optional[ReplicaGroups]:
    """torchft's Manager for this rank of replica group `ft.replica_id` (None when the section is off); `step`: the
    batches this group has done (after any resume), which ranks it against its peers when the quorum decides who
    heals whom. The groups' backend is the run's own: NCCL on CUDA, gloo on the CPU."""
    if not ft.enable:
        return None
    # torchft's Rust side logs every quorum and vote at INFO (8 lines a step on every rank); RUST_LOG=info brings
    # them back. Read once, when torchft is first imported.
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
    except ImportError as e:
        raise ConfigError(f"parallel.fault_tolerance.enable: needs the torchft package (pip install "
                          f"'torchft>=0.2'): {e}") from None
    lighthouse = ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not lighthouse:
        raise ConfigError("parallel.fault_tolerance.lighthouse: not set, and TORCHFT_LIGHTHOUSE is not in the "
                          "environment; expected the lighthouse's URL, e.g. http://host:29510 (tools/ft_local.sh "
                          "starts one)")
    store_addr, store_port, store = _group_store(rank, world_size)
    timeout = datetime.timedelta(seconds=ft.timeout)
    pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
    manager = Manager(pg=pg, load_state_dict=heal.load_state_dict, state_dict=heal.state_dict,
                      min_replica_size=ft.min_replicas, use_async_quorum=False, timeout=timeout,
                      quorum_timeout=datetime.timedelta(seconds=ft.quorum_timeout), connect_timeout=timeout,
                      rank=rank, world_size=world_size, store_addr=store_addr, store_port=store_port,
                      lighthouse_addr=lighthouse,
                      replica_id=f"internlm_core_{ft.replica_id}", max_retries=ft.max_retries)
    manager.load_state_dict({"step": step, "batches_committed": 0})
    logger.info(f"replica group {ft.replica_id} of {ft.group_size}: rank {rank} of {world_size} joins the quorum "
                f"of lighthouse {lighthouse} at step {step} (min_replicas {ft.min_replicas})")
    return TorchFTReplicas(manager, ft, heal, lighthouse, store, device)
