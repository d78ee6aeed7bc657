"""Activation checkpointing and compilation of a family's blocks (InternLM's `model.checkpoint`, `model.compile`).

Policies (`checkpoint_plan`):
  full        the whole block is recomputed in backward from its input (InternLM's checkpointing);
  selective   per operator (torch.utils.checkpoint's selective checkpointing, as torchtitan's `_save_list`): the
              outputs of the ops in SAVE_OPS (matmuls, attention kernels, functional collectives) are kept from the
              forward, everything else (norms, activations, rotary, softmax statistics, casts) is recomputed;
  a fraction  `full` on the first round(fraction * blocks) blocks.
Exchanges are never repeated under `selective`: the functional collectives (tensor parallel's DTensor
redistributions) are in the save list, and the in-place c10d exchanges (expert parallel's all_to_all, context
parallel's ring send/recv and all-gathers, EXCHANGE_OPS) are recorded in the forward and, in the recompute, their
receive buffers are filled from the record instead of communicating (`_ExchangeRecord` / `_ExchangeReplay`).
Context parallel's ring with `selective` hung in its first step through train.py (cause not found): the config
refuses that pair (config/loader.py); the all_to_all mode and expert parallel's exchanges train bitwise.
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Callable, Union

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..config.recompute import POLICIES, checkpoint_plan

__all__ = ["POLICIES", "checkpoint_and_compile", "checkpoint_plan", "save_ops", "selective_policy"]

# the ops whose outputs `selective` keeps (torchtitan's _save_list, plus the other matmul spellings and the
# collectives): (namespace, op, overload); an op a supported torch lacks cannot occur and is left out
SAVE_LIST = (
    ("aten", "mm", "default"), ("aten", "addmm", "default"), ("aten", "bmm", "default"),
    ("aten", "baddbmm", "default"), ("aten", "_grouped_mm", "default"), ("aten", "_scaled_mm", "default"),
    ("aten", "_scaled_dot_product_efficient_attention", "default"),
    ("aten", "_scaled_dot_product_flash_attention", "default"),
    ("aten", "_scaled_dot_product_flash_attention_for_cpu", "default"),
    ("aten", "_scaled_dot_product_cudnn_attention", "default"),
    ("aten", "_scaled_dot_product_attention_math", "default"),
    ("aten", "_scaled_dot_product_fused_attention_overrideable", "default"),
    ("aten", "max", "default"),  # float8's amax (torchtitan)
    ("_c10d_functional", "all_gather_into_tensor", "default"), ("_c10d_functional", "all_reduce", "default"),
    ("_c10d_functional", "reduce_scatter_tensor", "default"), ("_c10d_functional", "all_to_all_single", "default"),
    ("_c10d_functional", "broadcast", "default"), ("_c10d_functional", "wait_tensor", "default"),
)
# every op of these namespaces is kept too: flash-attn's kernels (their forward outputs) and functional collectives
SAVE_NAMESPACES = ("_c10d_functional", "flash_attn")
# this code base's own matmul ops (namespace, name): the CPU linear's oneDNN GEMM (model/layers.py), which a plain
# fp32 CPU run's linears dispatch to instead of aten.mm
SAVE_CUSTOM = (("internlm_core", "onednn_matmul"),)
# in-place c10d exchanges replayed from the forward's record: c10d op name -> whether it writes its first argument
EXCHANGE_OPS = {"alltoall_base_": True, "alltoall_": True, "allgather_": True, "recv_": True,
                "recv_any_source_": True, "send": False}


def _resolve(namespace: str, name: str, overload: str) -> Any:
    packet = getattr(getattr(torch.ops, namespace), name, None) if hasattr(torch.ops, namespace) else None
    return getattr(packet, overload, None) if packet is not None else None


@functools.lru_cache(maxsize=1)
def save_ops() -> frozenset:
    """The OpOverloads of SAVE_LIST this torch has."""
    return frozenset(op for op in (_resolve(*entry) for entry in SAVE_LIST) if op is not None)


def selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The per-op decision of `selective`: keep matmuls, attention and functional collectives, recompute the rest."""
    namespace = getattr(func, "namespace", None)
    if func in save_ops() or namespace in SAVE_NAMESPACES or (namespace, getattr(func, "_opname", None)) in SAVE_CUSTOM:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _exchange(func: Any) -> bool:
    return getattr(func, "namespace", None) == "c10d" and func._opname in EXCHANGE_OPS


def _written(func: Any, args: tuple) -> list[torch.Tensor]:
    if not EXCHANGE_OPS[func._opname]:
        return []
    first = args[0]
    if isinstance(first, torch.Tensor):
        return [first]
    return [t for part in first for t in (part if isinstance(part, (list, tuple)) else [part])]


class _ExchangeRecord(TorchDispatchMode):
    """Forward: every exchange's receive buffers (kept, as saved activations) and result (its Work)."""

    def __init__(self, log: collections.deque):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _exchange(func):
            self.log.append((func, [(t.detach(), t._version) for t in _written(func, args)], out))
        return out


class _ExchangeReplay(TorchDispatchMode):
    """Recompute: each exchange fills its buffers from the forward's record and returns its (completed) Work."""

    def __init__(self, log: collections.deque):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _exchange(func):
            return func(*args, **(kwargs or {}))
        if not self.log or self.log[0][0] is not func:
            raise RuntimeError(f"selective activation checkpointing: the recompute ran {func} where the forward "
                               f"ran {self.log[0][0] if self.log else 'no more exchanges'}")
        _, saved, out = self.log.popleft()
        for (src, version), dst in zip(saved, _written(func, args)):
            if src._version != version:
                raise RuntimeError(f"selective activation checkpointing: {func}'s received buffer was modified "
                                   f"in place after the forward")
            dst.copy_(src)
        if isinstance(out, tuple):  # (the written tensors, Work)
            return (args[0],) + out[1:]
        return out


# ops torch's selective checkpoint modes pass through uncounted (as its SAC_IGNORED_OPS): record_function's
# profiler annotations, which FSDP2's hooks of a unit nested in the block (expert parallel's experts) enter a
# different number of times in the forward and the recompute ("invocation index 2 encountered during backward but
# not found in storage"; torch fixes it in pytorch/pytorch#196862)
IGNORED_NAMESPACES = ("profiler",)


@functools.lru_cache(maxsize=None)
def _passing_annotations(mode_class: type) -> type:
    """`mode_class` (one of torch's selective checkpoint modes) that runs IGNORED_NAMESPACES' ops uncounted."""
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", None) in IGNORED_NAMESPACES:
            return func(*args, **(kwargs or {}))
        return mode_class.__torch_dispatch__(self, func, types, args, kwargs)
    return type(mode_class.__name__, (mode_class,), {"__torch_dispatch__": __torch_dispatch__})


def selective_contexts() -> tuple[Any, Any]:
    """The `context_fn` of `selective`: torch's selective checkpoint contexts above the exchange record/replay
    (entered first, so that torch's caching mode, on top, hands down to the replay the exchanges it recomputes)."""
    log: collections.deque = collections.deque()
    forward, recompute = create_selective_checkpoint_contexts(selective_policy)
    for mode in (forward, recompute):
        mode.__class__ = _passing_annotations(type(mode))
    return _Pair(_ExchangeRecord(log), forward), _Pair(_ExchangeReplay(log), recompute)


class _Pair:
    """Two context managers entered as one, `lower` first."""

    def __init__(self, lower: Any, upper: Any):
        self.lower, self.upper = lower, upper

    def __enter__(self):
        self.lower.__enter__()
        self.upper.__enter__()
        return self

    def __exit__(self, *exc):
        self.upper.__exit__(*exc)
        return self.lower.__exit__(*exc)


def _checkpointed(inner: Callable, policy: str) -> Callable:
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation keeps nothing anyway
            return inner(*args, **kwargs)
        if policy == "selective":
            return checkpoint(inner, *args, use_reentrant=False, context_fn=selective_contexts, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)
    return forward


def checkpoint_and_compile(blocks: list[nn.Module], setting: Union[bool, float, str], compile: bool) -> int:
    """Recompute blocks in backward as `setting` says (`checkpoint_plan`: the first round(fraction * len(blocks))
    blocks, whole or selectively) and, with `compile`, compile every block (inside the recomputed function for
    checkpointed ones, never checkpointing inside a graph). Returns how many blocks are checkpointed. Parameter
    names do not change (no wrapper modules)."""
    policy, frac = checkpoint_plan(setting)
    n = round(frac * len(blocks))
    for i, block in enumerate(blocks):
        if i < n:
            inner = block.forward  # the class's forward, bound
            block.forward = _checkpointed(torch.compile(inner) if compile else inner, policy)
        elif compile:
            block.compile()
    return n
