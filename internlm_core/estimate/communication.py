"""FSDP's collectives per training step on one rank, as parallel.CommCounter counts them."""

from __future__ import annotations

from .figures import Communication, Layout


def fsdp_communication(lay: Layout, micro_num: int, grad_reduce: str, stage: str, layers: int, block: float,
                       embedding: float, head: float, gathered_itemsize: int) -> Communication:
    """FSDP's all-gathers and reduce-scatters per step on a rank of `stage` ("all" without pipeline parallel).

    FSDP units: every block, and the root (what the blocks leave: embedding, final norm, output); `block`,
    `embedding`, `head` are the parameters one rank holds of each unsharded (its tensor-parallel shard).
    Without pipeline parallel a block is gathered for its forward and again for its backward (it reshards after
    forward) and the root once, every micro-batch. Under 1F1B a stage keeps its blocks gathered from a forward
    to the next backward and reshards after each backward: one gather per micro-batch. Reduce-scatters: every
    unit every micro-batch ("micro_batch") or once per step ("step"), in fp32. These are a steady step's
    figures: a pipeline's first step adds the schedule's shape-inference forward, and a step after a validation
    finds the weights the validation left gathered (measured in tests/dist/test_parallel.py).
    """
    out = Communication()
    if lay.dp_shard <= 1:
        return out
    root = (embedding if stage in ("all", "first") else 0.0) + (head if stage in ("all", "last") else 0.0)
    units = [(block, 2 if lay.pp == 1 else 1)] * layers
    if root:
        units.append((root, 1))
    reduces_each = micro_num if grad_reduce == "micro_batch" else 1
    for params, gathers in units:
        out.gathers += gathers * micro_num
        out.gathered_bytes += gathers * micro_num * params * gathered_itemsize
        out.reduces += reduces_each
        out.reduced_bytes += reduces_each * params * 4
    return out
