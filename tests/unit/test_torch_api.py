"""The torch API range by construction (issue 33 item 7): every torch name that internlm_core/, tools/, bench/ and
train.py reach is in the oldest supported torch (2.11), the pinned one the tests run on (2.13) and the newest (2.15),
as read from those wheels' own sources and stubs (tests/fixtures/torch_api/*.json, written by
tools/torch_api_names.py extract; no download here). Names that differ between them go through
internlm_core/utils/torch_compat.py.

Before issue 33's fix the first test failed with
  internlm_core/utils/collectives.py:131 torch.distributed.all_gather_single: not in torch 2.11.0
(and the same for reduce_scatter_single, and PipelineStage._warmup_backward_result in 2.11 and 2.15). Calls are
checked for their keyword arguments too, against the signature each version's sources give.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import torch_api_names as api  # noqa: E402

OLDEST, PINNED, NEWEST = api.SUPPORTED


@pytest.fixture(scope="module")
def apis() -> dict[str, dict]:
    return {v: api.load_fixture(v) for v in api.SUPPORTED}


@pytest.fixture(scope="module")
def uses() -> list[api.Use]:
    return api.package_uses()


def scan(source: str, rel: str = "internlm_core/x.py") -> list[api.Use]:
    return api.uses_in(rel, source)


def test_every_torch_name_used_is_in_every_supported_torch(uses, apis):
    found = api.problems(uses, apis)
    assert not found, ("torch names a supported torch lacks (use a name every supported version has, or go "
                       "through internlm_core/utils/torch_compat.py; a module the fixtures do not list yet: "
                       "`python tools/torch_api_names.py extract <the wheels>` rewrites them):\n  "
                       + "\n  ".join(found))


def test_the_scan_sees_the_package_use_torch(uses):
    """No blind scan: the names the package is known to reach are among the uses, found through each kind of
    binding (plain `torch.`, `dist.` and `F.` aliases, `from torch.x import y`, getattr probes, class members)."""
    dotted = {u.dotted for u in uses}
    assert {"torch.distributed.all_gather_into_tensor", "torch.distributed.reduce_scatter_tensor",
            "torch.nn.functional.scaled_dot_product_attention", "torch.distributed.fsdp.fully_shard",
            "torch.distributed.checkpoint.state_dict.get_model_state_dict", "torch._grouped_mm",
            "torch.distributed.ReduceOp.SUM", "torch.backends.cudnn.conv.fp32_precision",
            "torch.distributed.pipelining.PipelineStage._warmup_backward_result"} <= dotted
    files = {u.where.split(":")[0].split("/")[0] for u in uses}
    assert {"internlm_core", "tools", "bench"} <= files  # train.py is scanned too; it imports no torch itself
    assert ROOT / "train.py" in set(api.scanned_files())
    assert len(dotted) > 200


def test_the_scan_finds_item_1s_names_through_every_kind_of_binding(apis):
    source = ("import torch\nimport torch.distributed as dist\nfrom torch import distributed as d2\n"
              "from torch.distributed import reduce_scatter_single\n"
              "def f(a, b):\n    dist.all_gather_single(a, b)\n    d2.reduce_scatter_single(a, b)\n"
              "    torch.distributed.all_gather_into_tensor(a, b)\n    getattr(dist, 'all_gather_single', None)\n")
    found = api.problems(scan(source), apis)
    assert found == [
        "internlm_core/x.py:4 torch.distributed.reduce_scatter_single: not in torch 2.11.0",
        "internlm_core/x.py:6 torch.distributed.all_gather_single: not in torch 2.11.0",
        "internlm_core/x.py:7 torch.distributed.reduce_scatter_single: not in torch 2.11.0",
        "internlm_core/x.py:9 torch.distributed.all_gather_single: not in torch 2.11.0"]


def test_the_scan_checks_functional_aliases_classes_and_submodules(apis):
    source = ("import torch.nn.functional as F\nfrom torch import nn\nfrom torch.distributed.pipelining import "
              "PipelineStage\nimport torch.distributed.no_such_module as nsm\n"
              "F.silu\nF.no_such_function\nnn.Module.no_such_method\nnn.Module.zero_grad\n"
              "hasattr(PipelineStage, '_warmup_backward_result')\ntorch_like = 1\ndist.whatever\n"
              "import torch\ntorch.ops.anything.at_all\n")
    found = api.problems(scan(source), apis)
    lines = sorted({line.split(": not in")[0] for line in found})
    assert lines == ["internlm_core/x.py:4 torch.distributed.no_such_module",
                     "internlm_core/x.py:6 torch.nn.functional.no_such_function",
                     "internlm_core/x.py:7 torch.nn.Module.no_such_method",
                     "internlm_core/x.py:9 torch.distributed.pipelining.PipelineStage._warmup_backward_result"]
    # the pinned torch has the warm-up vote, the oldest and the newest do not; every version lacks the typos
    vote = [line for line in found if line.startswith("internlm_core/x.py:9 ")]
    assert [line.rsplit(" ", 1)[1] for line in vote] == [OLDEST, NEWEST]
    assert sum(line.startswith("internlm_core/x.py:6 ") for line in found) == len(api.SUPPORTED)


def test_the_scan_checks_the_keywords_a_call_passes(apis):
    """A keyword argument a version's signature does not take fails like a missing name: 2.13 added barrier's
    `timeout` and fully_shard's `dp_mesh_dims`, and dropped the factories' `names`."""
    source = ("import torch\nimport torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\n"
              "dist.barrier(timeout=1)\nfully_shard(m, mesh=None, dp_mesh_dims=None)\ntorch.zeros(2, names=None)\n"
              "torch.zeros(2, dtype=None, device=None)\ndist.barrier(group=None)\n")
    assert api.problems(scan(source), apis) == [
        "internlm_core/x.py:4 torch.distributed.barrier(timeout=): not in torch 2.11.0",
        "internlm_core/x.py:5 torch.distributed.fsdp.fully_shard(dp_mesh_dims=): not in torch 2.11.0",
        "internlm_core/x.py:6 torch.zeros(names=): not in torch 2.13.0",
        "internlm_core/x.py:6 torch.zeros(names=): not in torch 2.15.0"]
    # a call the fixtures were written without (the package calls torch.kron nowhere): regenerate, not a pass
    stale = api.problems(scan("import torch\ntorch.kron(a, b, out=None)\n"), apis)
    assert stale[0] == ("internlm_core/x.py:2 torch.kron(...) (the fixture has no signature for it: regenerate it): "
                        "not in torch 2.11.0") and len(stale) == len(api.SUPPORTED)


def test_the_compat_module_may_use_a_name_one_supported_torch_has(apis):
    source = ("from torch.distributed.pipelining import PipelineStage\n"
              "hasattr(PipelineStage, '_warmup_backward_result')\nhasattr(PipelineStage, '_no_such_vote')\n")
    assert api.problems(scan(source, api.COMPAT), apis) == [
        f"{api.COMPAT}:3 torch.distributed.pipelining.PipelineStage._no_such_vote: in no supported torch"]
    outside = api.problems(scan(source, "internlm_core/parallel/x.py"), apis)
    assert any("_warmup_backward_result: not in torch 2.11.0" in line for line in outside)


def test_the_fixtures_were_read_from_each_versions_sources(apis):
    """Anchors in each version's names, one per way a name gets there: a plain def, a stub of the C extension,
    the loop copying torch._C._VariableFunctions (private names too), a module replacing itself with a class."""
    dist = {v: set(a["modules"]["torch.distributed"]) for v, a in apis.items()}
    assert "all_gather_into_tensor" in dist[OLDEST] and "all_gather_single" not in dist[OLDEST]
    assert {"all_gather_single", "all_gather_into_tensor", "reduce_scatter_tensor"} <= dist[PINNED] & dist[NEWEST]
    for v, a in apis.items():
        assert a["torch_version"] == v
        assert {"zeros", "cat", "_grouped_mm", "float32", "autocast", "distributed"} <= set(a["modules"]["torch"])
        assert "conv" in a["modules"]["torch.backends.cudnn"]
        assert "SUM" in a["classes"]["torch.distributed.ReduceOp"]
        assert "_current_graph_task_id" in a["modules"]["torch._C"]
        assert {"mesh", "reshard_after_forward", "mp_policy"} <= set(
            a["signatures"]["torch.distributed.fsdp.fully_shard"]["params"])


def test_the_installed_check_of_the_gpu_row_finds_what_is_missing():
    """tools/gpu_check.sh's row runs `missing_installed` on the GPU machine's own torch: it imports each module part
    of a chain, looks the next part up, and a class's member after it. Shown on the standard library's json and
    email packages (the same code; torch's import alone would take most of this file's time budget)."""
    uses = [api.Use(("json", "decoder", "JSONDecoder", "decode"), "a.py:1"),
            api.Use(("json", "no_such_function"), "a.py:2"),
            api.Use(("json", "decoder", "JSONDecoder", "no_such_method"), "a.py:3"),
            api.Use(("email", "mime", "text", "MIMEText"), "a.py:4"),
            api.Use(("email", "no_such_module", "x"), "a.py:5"),
            api.Use(("torch", "ops", "no_such_namespace"), "a.py:6"),
            api.Use(("json", "no_such_name"), f"{api.COMPAT}:7")]
    assert api.missing_installed(uses) == [  # torch.ops (DYNAMIC) and the compat module's use are not looked up
        "a.py:2 json.no_such_function", "a.py:3 json.decoder.JSONDecoder.no_such_method",
        "a.py:5 email.no_such_module.x"]


def test_the_supported_range_is_said_the_same_everywhere():
    """requirements.txt pins the middle version and states the range; the GPU check's version row and the
    README say the same range."""
    requirements = (ROOT / "requirements.txt").read_text()
    assert re.search(r"^torch==(\S+)$", requirements, re.M).group(1) == PINNED
    low, high = (".".join(v.split(".")[:2]) for v in (OLDEST, NEWEST))
    assert f"Supported torch: {low} to {high}" in requirements
    rows = (ROOT / "bench/gpu_rows.py").read_text()  # not imported: that costs a torch import
    assert f"SUPPORTED_TORCH = (({low.replace('.', ', ')}), ({high.replace('.', ', ')}))" in rows
    assert f"torch {low} to {high}" in (ROOT / "README.md").read_text()
    for v in api.SUPPORTED:
        assert json.loads((api.FIXTURES / f"{v}.json").read_text())["wheel"].startswith(f"torch-{v}-")
