"""Device placement, checked on a CPU machine where a CUDA run would fail (issue 27, item 8).

1. Every collective of the package goes through `internlm_core.utils.collectives` (one door, which checks that each
   tensor is on its process group's device); a raw `dist.<collective>` elsewhere is an error.
2. The distributed code paths (every module that issues collectives through that door) make no tensor without
   naming its device: `torch.zeros(...)` without `device=` is a host tensor, which NCCL rejects.
3. The device audit (tests/helpers/device_audit.py) runs code on a one-rank gloo group as if the run and the group
   were on CUDA: a host tensor in a collective fails as NCCL would; the loop's metric on a pipeline stage without
   outputs passes (it failed before issue 27's fix). tests/dist/test_device_audit.py runs a two-stage pipeline's
   per-step collectives the same way on two ranks.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from internlm_core.metrics import AccPerplex
from internlm_core.monitor.stop import StopController
from internlm_core.optim.clip import global_grad_norm
from internlm_core.utils import collectives
from internlm_core.utils.collectives import DevicePlacementError
from tests.helpers.device_audit import audit_devices, marked

PACKAGE = Path(__file__).resolve().parents[2] / "internlm_core"
DOOR = "internlm_core/utils/collectives.py"

COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_gather_single",
               "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast",
               "broadcast_object_list", "gather", "gather_object", "irecv", "isend", "monitored_barrier", "recv",
               "reduce", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "scatter",
               "scatter_object_list", "send"}
FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint", "linspace", "eye"}

# path (a file, or a folder ending in /) -> why it may call torch.distributed's collectives directly (remove the
# entry once it goes through the door)
RAW_COLLECTIVES_ALLOWED: dict[str, str] = {}


def _raw_allowed(rel: str) -> bool:
    return any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in RAW_COLLECTIVES_ALLOWED)

# (path, function, factory) -> why a tensor made there without `device=` is right
HOST_FACTORIES_ALLOWED = {
    ("internlm_core/parallel/pipeline.py", "_warmup_backward_result", "ones"):
        "a simulated job's stage (the fake backend takes any device): torch's own warm-up vote is a host tensor",
}


def _sources() -> list[tuple[str, ast.Module]]:
    return [(p.relative_to(PACKAGE.parent).as_posix(), ast.parse(p.read_text(encoding="utf-8")))
            for p in sorted(PACKAGE.rglob("*.py"))]


def _is_dist(node: ast.expr) -> bool:
    """`dist` or `torch.distributed`."""
    if isinstance(node, ast.Name):
        return node.id == "dist"
    return (isinstance(node, ast.Attribute) and node.attr == "distributed" and isinstance(node.value, ast.Name)
            and node.value.id == "torch")


def raw_collectives(rel: str, tree: ast.Module) -> list[str]:
    """`path:line dist.<name>` of every collective called on torch.distributed, and every one imported from it."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES
                and _is_dist(node.func.value)):
            found.append(f"{rel}:{node.lineno} dist.{node.func.attr}")
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found += [f"{rel}:{node.lineno} from torch.distributed import {a.name}" for a in node.names
                      if a.name in COLLECTIVES]
    return found


def uses_the_door(tree: ast.Module) -> bool:
    """The module imports internlm_core.utils.collectives (relatively or not)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.endswith("utils.collectives") or (module.endswith("utils") and
                                                         any(a.name == "collectives" for a in node.names)):
                return True
    return False


def host_factories(rel: str, tree: ast.Module) -> list[tuple[str, str, str, int]]:
    """(path, enclosing function, factory, line) of every `torch.<factory>(...)` call without `device=`."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and child.func.attr in FACTORIES and isinstance(child.func.value, ast.Name)
                    and child.func.value.id == "torch" and not any(k.arg == "device" for k in child.keywords)):
                found.append((rel, function, child.func.attr, child.lineno))
            visit(child, name)
    visit(tree, "<module>")
    return found


def distributed_modules() -> list[tuple[str, ast.Module]]:
    """The distributed code paths: the door itself and every module that issues collectives through it."""
    return [(rel, tree) for rel, tree in _sources() if rel == DOOR or uses_the_door(tree)]


# ---- 1 and 2: the lint ------------------------------------------------------------------------------------------

def test_every_collective_goes_through_the_door():
    offenders = [o for rel, tree in _sources() if rel != DOOR and not _raw_allowed(rel)
                 for o in raw_collectives(rel, tree)]
    assert not offenders, ("collectives outside internlm_core/utils/collectives.py (use its functions: they check "
                           "the device):\n  " + "\n  ".join(offenders))


def test_distributed_code_names_the_device_of_every_tensor_it_makes():
    modules = dict(distributed_modules())
    # the modules whose collectives a pipeline stage issues every step are all in the set
    for rel in ("internlm_core/metrics.py", "internlm_core/trainer/trainer.py", "internlm_core/optim/clip.py",
                "internlm_core/monitor/stop.py", "internlm_core/monitor/straggler.py",
                "internlm_core/parallel/pipeline.py", "internlm_core/parallel/comm.py",
                "internlm_core/checkpoint/collectives.py", "internlm_core/checkpoint/foreign.py"):
        assert rel in modules, rel
    found = [f for rel, tree in modules.items() for f in host_factories(rel, tree)]
    offenders = [f"{rel}:{line} torch.{fac}(...) in {fn} without device=" for rel, fn, fac, line in found
                 if (rel, fn, fac) not in HOST_FACTORIES_ALLOWED]
    assert not offenders, "host tensors in distributed code (NCCL rejects them):\n  " + "\n  ".join(offenders)
    stale = set(HOST_FACTORIES_ALLOWED) - {(rel, fn, fac) for rel, fn, fac, _ in found}
    assert not stale, f"allowed exceptions that no longer exist: {sorted(stale)}"


def test_the_lint_finds_a_host_tensor_and_a_raw_collective():
    source = ("import torch\nimport torch.distributed as dist\n\nclass M:\n    def get_metric(self):\n"
              "        sums = torch.zeros(3, 4, dtype=torch.float64)\n        dist.all_reduce(sums)\n"
              "        ok = torch.zeros(3, device=sums.device)\n")
    tree = ast.parse(source)
    assert host_factories("m.py", tree) == [("m.py", "get_metric", "zeros", 6)]
    assert raw_collectives("m.py", tree) == ["m.py:7 dist.all_reduce"]
    assert not uses_the_door(tree)
    assert uses_the_door(ast.parse("from ..utils import collectives\n"))


# ---- 3: the device audit on one gloo rank -------------------------------------------------------------------------

@pytest.fixture
def group():
    """A one-rank gloo process group (the default group), destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_outside_the_audit_the_door_checks_the_backends_device(group):
    assert collectives.group_device(group) == torch.device("cpu")
    t = torch.ones(2)
    collectives.all_reduce(t, group=group)
    assert t.tolist() == [1.0, 1.0]
    with pytest.raises(DevicePlacementError, match=r"all_reduce on a gloo process group: a \(2,\) torch.float32 "
                                                   r"tensor on meta, expected one on cpu"):
        collectives.all_reduce(torch.ones(2, device="meta"), group=group)


def test_the_audit_fails_a_host_tensor_as_nccl_would_and_keeps_real_values(group):
    with audit_devices("cuda") as device:
        assert collectives.group_device(group) == device == torch.device("cuda", 0)
        on_device = torch.tensor([1.0, 2.0], device=device)
        derived = (on_device * 2).sum(dim=0, keepdim=True)  # computed from it: on the device too
        assert marked(derived) and derived.device == device
        collectives.all_reduce(derived, group=group)
        assert derived.item() == 6.0
        host = torch.zeros(2)  # no device: a host tensor, as on a CUDA run
        with pytest.raises(DevicePlacementError, match=r"all_reduce on a gloo process group: a \(2,\) torch.float32 "
                                                       r"tensor on cpu, expected one on cuda:0"):
            collectives.all_reduce(host, group=group)
        with pytest.raises(DevicePlacementError, match="all_reduce .* on cpu"):
            collectives.all_reduce(on_device.cpu(), group=group)  # moved to the host
        collectives.all_reduce(host.to(device), group=group)
        with pytest.raises(DevicePlacementError, match=r"mixes a tensor on cuda:0 with a \(2,\) torch.float32 host"):
            torch.stack([on_device, host])  # a CUDA kernel takes no host tensor beside a device one


def test_the_metric_of_a_stage_without_outputs_meets_the_audit(group):
    """AccPerplex.get_metric on a rank that never called update (every pipeline stage but the last): its zeros
    are made on the group's device (issue 27: a host tensor, which NCCL rejects at step 1)."""
    with audit_devices("cuda") as device:
        m = AccPerplex({0: "en"}, group).get_metric()
        assert m == {"tokens": 0.0}
        metric = AccPerplex({0: "en"}, group)
        labels = torch.tensor([[1, 2, -100]], device=device)
        metric.update(torch.eye(3, device=device)[[1, 0, 2]].unsqueeze(0), labels)
        m = metric.get_metric()
    assert m["tokens"] == 2.0 and m["acc"] == 0.5


def test_the_stop_poll_and_the_norm_of_a_stage_without_gradients_meet_the_audit(group):
    with audit_devices("cuda") as device:
        stop = StopController(None, rank=0, signals=(), group=group)
        assert not stop.poll(step=3).stop
        norm = global_grad_norm([torch.nn.Parameter(torch.ones(2, device=device))], pp_group=group)
        assert marked(norm) and norm.item() == 0.0  # no gradient here, yet the stages' sum is joined
        p = torch.nn.Parameter(torch.ones(2, device=device))
        p.grad = torch.full((2,), 3.0, device=device)
        assert math.isclose(global_grad_norm([p], pp_group=group).item(), 18 ** 0.5, rel_tol=1e-6)
