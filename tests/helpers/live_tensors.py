"""The peak bytes of CPU tensors alive at once, at the granularity of torch's operators (a TorchDispatchMode).

    with LiveTensorBytes(exclude=[p for p in model.parameters()] + grads) as live:
        loss.backward()
    live.peak   # bytes of the storages created inside the block that were alive together, at their most

Every operator's outputs are recorded by storage (views share one); a storage counts until it is freed
(StorageWeakRef.expired), polled after each operator. What the block creates and keeps (autograd's saved tensors,
autocast's cached casts, temporaries) counts; storages that existed before (`exclude`) do not. Memory that is not
a tensor (a kernel's own scratch space, the process's code) is not seen: the estimator's terms, without the noise
of a process's resident set.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    def __init__(self, exclude: Iterable[Optional[torch.Tensor]] = ()):
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in exclude if t is not None}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.bytes = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if not key or key in self.known:
                    continue
                if key in self.live and self.live[key][0].expired():  # a freed storage's address, reused
                    self.bytes -= self.live.pop(key)[1]
                if key not in self.live:
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.bytes += storage.nbytes()
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.bytes -= self.live.pop(key)[1]
        self.peak = max(self.peak, self.bytes)
        return out
