"""numerics: Precision from model.dtype, and every kernel choice of select_kernels as a table over the conditions
(dtype, device, DTensor parameters from the layout, accelerators missing / working / installed but broken)."""

import dataclasses
import logging
import sys
import types

import pytest
import torch

from internlm_core.config.loader import _DTYPES
from internlm_core.config.schema import AdamConfig, ModelConfig
from internlm_core.errors import ConfigError
from internlm_core.numerics import DTYPE_NAMES, Probes, resolve_precision, select_kernels
from internlm_core.utils import accelerators
from internlm_core.utils.accelerators import NOT_INSTALLED, WORKING, Probe

BROKEN = Probe(installed=True, ok=False, detail="ImportError: flash_attn_2_cuda.so: undefined symbol: _ZN3c10")
ALL = Probes(flash_attn=WORKING, flash_cross_entropy=WORKING, apex=WORKING)
NONE = Probes()
CPU = Probes(onednn=True)  # a CPU without native 16-bit GEMM (AVX2), like this machine
CPU_AMX = Probes(onednn=True, native_half_gemm=(torch.bfloat16, torch.float16))
FSDP8 = dict(dp=8, dp_shard=8, micro_num=4)  # configs/7B.py on 8 GPUs: zero1=8

# id: (dtype, device, layout, probes, model / adam / loss overrides) -> (attention, cross entropy, linear, optimizer,
# gradient reduction), warnings
TABLE = {
    "cpu fp32": ("torch.float32", "cpu", {}, CPU, {}, ("cpu_blocked", "fused_chunked", "onednn", "fused", "step"), 0),
    "cpu bf16 compiled": ("torch.bfloat16", "cpu", {}, CPU, {"compile": True},
                          ("cpu_blocked", "fused_chunked_compiled", "fp32_gemm", "fused", "step"), 0),
    "cpu label smoothing": ("torch.bfloat16", "cpu", {}, CPU, {"label_smoothing": 0.1},
                            ("cpu_blocked", "torch", "fp32_gemm", "fused", "step"), 0),
    "cpu with native bf16 GEMM": ("torch.bfloat16", "cpu", {}, CPU_AMX, {},
                                  ("cpu_blocked", "fused_chunked", "onednn", "fused", "step"), 0),
    "cpu fp16 without native GEMM": ("torch.float16", "cpu", {}, CPU, {},
                                     ("cpu_blocked", "fused_chunked", "fp32_gemm", "fused", "step"), 0),
    "cpu asks for sdpa": ("torch.float32", "cpu", {}, CPU, {"attn_backend": "sdpa"},
                          ("sdpa", "fused_chunked", "onednn", "fused", "step"), 0),
    "cpu dp 2 (FSDP)": ("torch.float32", "cpu", dict(dp=2, dp_shard=2, micro_num=2), CPU, {},
                        ("cpu_blocked", "fused_chunked", "onednn", "fused", "micro_batch"), 0),
    "cuda bf16, one GPU": ("torch.bfloat16", "cuda", {}, ALL, {}, ("flash", "flash", "torch", "apex", "step"), 0),
    "cuda bf16, FSDP 8: no apex": ("torch.bfloat16", "cuda", FSDP8, ALL, {},
                                   ("flash", "flash", "torch", "fused", "micro_batch"), 0),
    "cuda bf16, HSDP 8 x 2": ("torch.bfloat16", "cuda", dict(dp=16, dp_shard=8, micro_num=4), ALL, {},
                              ("flash", "flash", "torch", "fused", "micro_batch"), 0),
    "cuda bf16, replicated dp 8": ("torch.bfloat16", "cuda", dict(dp=8, dp_shard=1, micro_num=4), ALL, {},
                                   ("flash", "flash", "torch", "fused", "step"), 0),
    "cuda bf16, one micro-batch": ("torch.bfloat16", "cuda", dict(dp=8, dp_shard=8, micro_num=1), ALL, {},
                                   ("flash", "flash", "torch", "fused", "step"), 0),
    "cuda bf16, pipeline": ("torch.bfloat16", "cuda", dict(dp=4, dp_shard=4, pp=2, micro_num=4), ALL, {},
                            ("flash", "flash", "torch", "fused", "micro_batch"), 0),
    "cuda bf16, tensor parallel": ("torch.bfloat16", "cuda", dict(tp=2), ALL, {},
                                   ("flash", "vocab_parallel", "torch", "fused", "step"), 0),
    "cuda fp16": ("torch.float16", "cuda", {}, ALL, {}, ("flash", "flash", "torch", "apex", "step"), 0),
    "cuda fp32: no flash-attn": ("torch.float32", "cuda", {}, ALL, {}, ("sdpa", "flash", "torch", "apex", "step"), 0),
    "cuda tf32: no flash-attn": ("torch.tf32", "cuda", {}, ALL, {}, ("sdpa", "flash", "torch", "apex", "step"), 0),
    "cuda fp32, flash asked": ("torch.float32", "cuda", {}, ALL, {"attn_backend": "flash"},
                               ("flash", "flash", "torch", "apex", "step"), 0),
    "cuda use_flash_attn=False": ("torch.bfloat16", "cuda", {}, ALL, {"use_flash_attn": False},
                                  ("sdpa", "flash", "torch", "apex", "step"), 0),
    "cuda adam.fused=torch": ("torch.bfloat16", "cuda", {}, ALL, {"fused": "torch"},
                              ("flash", "flash", "torch", "fused", "step"), 0),
    "cuda nothing installed": ("torch.bfloat16", "cuda", {}, NONE, {},
                               ("sdpa", "fused_chunked", "torch", "fused", "step"), 0),
    "cuda flash-attn broken": ("torch.bfloat16", "cuda", {}, Probes(BROKEN, BROKEN, NOT_INSTALLED), {},
                               ("sdpa", "fused_chunked", "torch", "fused", "step"), 1),
    "cuda flash-attn and apex broken": ("torch.bfloat16", "cuda", {}, Probes(BROKEN, BROKEN, BROKEN), {},
                                        ("sdpa", "fused_chunked", "torch", "fused", "step"), 2),
    "cuda fp32, flash-attn's loss broken": ("torch.float32", "cuda", {}, Probes(BROKEN, BROKEN, WORKING), {},
                                            ("sdpa", "fused_chunked", "torch", "apex", "step"), 1),
}


def configs(overrides: dict):
    model_keys = {f.name for f in dataclasses.fields(ModelConfig)}
    model = dataclasses.replace(ModelConfig(), **{k: v for k, v in overrides.items() if k in model_keys})
    adam = dataclasses.replace(AdamConfig(), **{k: v for k, v in overrides.items() if k == "fused"})
    return model, adam, overrides.get("label_smoothing", 0.0)


@pytest.mark.parametrize("case", list(TABLE))
def test_selection_table(case, caplog):
    dtype, device, layout, probes, overrides, expected, n_warnings = TABLE[case]
    model, adam, smoothing = configs(overrides)
    with caplog.at_level(logging.INFO, logger="internlm_core"):
        k = select_kernels(model, adam, resolve_precision(dtype, device), device, label_smoothing=smoothing,
                           probes=probes, **layout)
    assert (k.attention, k.cross_entropy, k.linear, k.optimizer, k.grad_reduce) == expected
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == n_warnings == len(k.warnings), warnings
    infos = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels: ")]
    assert infos == [k.describe()]  # one line says what was chosen and why


def test_fp32_and_tf32_never_choose_flash_attn_on_their_own():
    model, adam, _ = configs({})
    for dtype in ("torch.float32", "torch.tf32"):
        k = select_kernels(model, adam, resolve_precision(dtype, "cuda"), "cuda", probes=ALL, log=False)
        assert k.attention == "sdpa" and "flash-attn takes 16-bit inputs" in k.describe()


def test_apex_is_never_chosen_for_dtensor_parameters():
    """adam.fused=auto with a working apex: apex only for plain tensors (one process, no tensor parallel)."""
    model, adam, _ = configs({})
    precision = resolve_precision("torch.bfloat16", "cuda")
    for layout in (dict(dp=2), dict(dp=8, dp_shard=8), dict(dp=8, dp_shard=1), dict(tp=2), dict(tp=2, dp=4)):
        k = select_kernels(model, adam, precision, "cuda", probes=ALL, log=False, **layout)
        assert k.optimizer == "fused", layout
        assert "apex not used: the parameters are DTensors" in k.notes
    assert select_kernels(model, adam, precision, "cuda", probes=ALL, log=False).optimizer == "apex"


def test_a_broken_flash_attn_falls_back_with_one_warning(caplog):
    model, adam, _ = configs({})
    with caplog.at_level(logging.WARNING, logger="internlm_core"):
        k = select_kernels(model, adam, resolve_precision("torch.bfloat16", "cuda"), "cuda",
                           probes=Probes(BROKEN, BROKEN, NOT_INSTALLED))
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning == ("flash-attn is installed but does not work (ImportError: flash_attn_2_cuda.so: undefined "
                       "symbol: _ZN3c10): attention falls back to SDPA, the loss falls back to fused_chunked")
    assert (k.attention, k.cross_entropy) == ("sdpa", "fused_chunked")


@pytest.mark.parametrize("overrides,device,probes,layout,message", [
    ({"attn_backend": "flash"}, "cpu", ALL, {},
     "model.attn_backend: 'flash' requested but the device is cpu, not cuda; use 'auto' or 'sdpa'"),
    ({"attn_backend": "flash"}, "cuda", Probes(BROKEN, BROKEN, WORKING), {},
     "model.attn_backend: 'flash' requested but flash-attn is installed but does not work (ImportError: "
     "flash_attn_2_cuda.so: undefined symbol: _ZN3c10); use 'auto' or 'sdpa'"),
    ({"fused": "apex"}, "cpu", ALL, {}, "adam.fused: 'apex' requested but the device is cpu, not cuda; use 'auto' "
     "or 'torch'"),
    ({"fused": "apex"}, "cuda", NONE, {}, "adam.fused: 'apex' requested but NVIDIA apex is not installed; use "
     "'auto' or 'torch'"),
    ({"fused": "apex"}, "cuda", ALL, FSDP8, "adam.fused: 'apex' requested but the parameters are DTensors (FSDP2 "
     "data parallel or tensor parallel), which apex's multi_tensor_adam cannot read; use 'auto' or 'torch'"),
])
def test_what_was_asked_for_and_cannot_run_is_a_config_error(overrides, device, probes, layout, message):
    model, adam, _ = configs(overrides)
    with pytest.raises(ConfigError) as e:
        select_kernels(model, adam, resolve_precision("torch.bfloat16", device), device, probes=probes, log=False,
                       **layout)
    assert str(e.value) == message


def test_precision_from_every_dtype_name():
    assert set(_DTYPES.values()) == set(DTYPE_NAMES)  # the config's spellings end in exactly these names
    bf16 = resolve_precision("torch.bfloat16", "cuda")
    assert (bf16.param_dtype, bf16.compute_dtype, bf16.reduce_dtype) == (torch.float32, torch.bfloat16, torch.float32)
    assert bf16.uses_autocast and not bf16.loss_scaling and not bf16.tf32 and bf16.export_name == "bfloat16"
    fp16 = resolve_precision("torch.float16", "cpu")
    assert fp16.loss_scaling and fp16.compute_dtype == torch.float16 and fp16.peak == "fp16"
    tf32 = resolve_precision("torch.tf32", "cuda")
    assert tf32.tf32 and not tf32.uses_autocast and tf32.peak == "tf32" and tf32.export_name == "float32"
    on_cpu = resolve_precision("torch.tf32", "cpu")  # no TF32 units: IEEE fp32, measured against fp32's peak
    assert not on_cpu.tf32 and on_cpu.peak == "fp32"
    fp32 = resolve_precision("torch.float32", "cpu")
    with fp32.autocast():
        assert not fp32.uses_autocast and not torch.is_autocast_enabled("cpu")
    with resolve_precision("torch.bfloat16", "cpu").autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with pytest.raises(ConfigError, match=r"model.dtype: expected one of torch.float32, torch.tf32, "
                                          r"torch.bfloat16, torch.float16, got 'bf16'"):
        resolve_precision("bf16", "cpu")


# ---- the probes: installed is not working ------------------------------------------------------------------------


@pytest.fixture
def fake_packages(tmp_path, monkeypatch):
    """Write packages into a folder on sys.path; probes and imports see them (and forget them afterwards)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    accelerators.clear_probe_cache()

    def write(files: dict[str, str]) -> None:
        for rel, text in files.items():
            path = tmp_path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    yield write
    for name in [m for m in sys.modules if m.split(".")[0] in ("flash_attn", "apex", "amp_C")]:
        del sys.modules[name]
    accelerators.clear_probe_cache()


def test_probe_sees_a_flash_attn_built_for_another_torch(fake_packages):
    fake_packages({"flash_attn/__init__.py": "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c10')"})
    for device_type in ("cpu", "cuda"):
        p = accelerators.probe_flash_attn(device_type)
        assert p.broken and p.detail == "ImportError: flash_attn_2_cuda.so: undefined symbol: _ZN3c10"
        assert accelerators.probe_flash_cross_entropy(device_type).broken


def test_probe_sees_apex_without_its_cuda_extensions(fake_packages):
    fake_packages({"apex/__init__.py": "", "apex/optimizers/__init__.py": "class FusedAdam: pass\n",
                   "apex/multi_tensor_apply/__init__.py":
                       "class _A:\n    available = False\nmulti_tensor_applier = _A()\n"})
    p = accelerators.probe_apex("cuda")
    assert p.broken and p.detail == "apex was built without its CUDA extensions (amp_C)"
    assert accelerators.probe_apex("cpu").broken


def test_probes_without_packages():
    accelerators.clear_probe_cache()
    assert accelerators.probe_flash_attn("cuda") == NOT_INSTALLED  # nothing installed on this machine
    assert accelerators.probe_apex("cuda") == NOT_INSTALLED


# ---- what the model and the optimizer do with the decision --------------------------------------------------------


def test_fp32_inputs_reach_flash_attn_as_bf16(monkeypatch):
    """attn_backend="flash" under fp32 compute: q/k/v are cast to bf16 for the kernel, the output back (a fake
    flash_attn stands in for the CUDA kernels and fails on anything but 16-bit inputs)."""
    from internlm_core.model.attention import attention, build_packed_meta
    seen = []

    def kernel(q, k, v, *args, causal, window_size):
        assert window_size == (-1, -1)  # no sliding window configured
        assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype
        seen.append((q.dtype, args))
        return q.clone()

    fake = types.ModuleType("flash_attn")
    fake.flash_attn_func, fake.flash_attn_varlen_func = kernel, kernel
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    q, k, v = (torch.randn(2, 16, h, 8) for h in (4, 2, 2))
    cu = torch.tensor([0, 5, 16, 32], dtype=torch.int32)
    for meta in (build_packed_meta(cu, 2, 16, "flash", torch.device("cpu")),
                 build_packed_meta(None, 2, 16, "flash", torch.device("cpu"))):
        out = attention(q, k, v, meta, "flash")
        assert out.dtype == torch.float32 and out.shape == q.shape
    assert [s[0] for s in seen] == [torch.bfloat16, torch.bfloat16]
    assert seen[0][1][0].tolist() == [0, 5, 16, 32] and seen[0][1][2] == 16  # cu_seqlens, max_seqlen


def test_apex_zero_grad_in_the_form_apex_accepts(monkeypatch):
    """apex's FusedAdam.zero_grad takes no arguments; the trainer and torch.distributed.checkpoint (resume) call
    zero_grad(set_to_none=True). A stand-in with apex's signature shows the wrapper calls it as apex accepts."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    from internlm_core.optim import build_optimizer, optimizer as optimizer_module
    calls = []

    class FusedAdam(torch.optim.AdamW):  # apex's constructor arguments and zero_grad signature
        def __init__(self, params, adam_w_mode=True, set_grad_none=True, **kwargs):
            super().__init__(params, **kwargs)
            self.set_grad_none = set_grad_none

        def zero_grad(self):  # noqa: D102 - exactly apex's form
            calls.append("apex")
            if self.set_grad_none:
                for group in self.param_groups:
                    for p in group["params"]:
                        p.grad = None
            else:
                super().zero_grad()

    apex, optimizers = types.ModuleType("apex"), types.ModuleType("apex.optimizers")
    optimizers.FusedAdam = FusedAdam
    monkeypatch.setitem(sys.modules, "apex", apex)
    monkeypatch.setitem(sys.modules, "apex.optimizers", optimizers)
    monkeypatch.setattr(optimizer_module, "_APEX_CLASS", None)
    model = torch.nn.Linear(4, 3)
    opt = build_optimizer(model, AdamConfig(), "apex")
    _init_optim_state(opt)  # what DCP does on resume: a zero step, then zero_grad(set_to_none=True)
    assert calls == ["apex"] and all(p.grad is None for p in model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.zero_grad(set_to_none=False)  # zeroes instead (torch's Optimizer)
    assert calls == ["apex"] and all(torch.all(p.grad == 0) for p in model.parameters())
    opt.zero_grad(set_to_none=True)  # the trainer's call
    assert calls == ["apex", "apex"] and all(p.grad is None for p in model.parameters())
    monkeypatch.setattr(optimizer_module, "_APEX_CLASS", None)


def test_apex_refuses_dtensor_parameters_built_by_hand():
    """select_kernels never gives apex DTensors; build_optimizer also refuses them when asked by hand."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from internlm_core.optim import build_optimizer
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 3, bias=False)
        model.weight = torch.nn.Parameter(DTensor.from_local(model.weight.detach(), init_device_mesh("cpu", (1,)),
                                                             [Replicate()]))
        with pytest.raises(ConfigError, match="apex's FusedAdam cannot update DTensor parameters"):
            build_optimizer(model, AdamConfig(), "apex")
        assert isinstance(build_optimizer(model, AdamConfig(), "fused"), torch.optim.AdamW)
    finally:
        if created:
            dist.destroy_process_group()


def test_expert_gemm_is_chosen_once_per_device():
    """moe.expert_gemm: auto takes the grouped GEMM on CUDA where it runs for the compute dtype, the per-expert loop
    on the CPU and where it does not run; an explicit choice that cannot run is one ConfigError."""
    from internlm_core.numerics.kernels import select_expert_gemm
    bf16 = torch.bfloat16
    assert select_expert_gemm("auto", "cuda", bf16, [], grouped_runs=True) == "grouped"
    notes = []
    assert select_expert_gemm("auto", "cuda", torch.float32, notes, grouped_runs=False) == "loop"
    assert "no grouped GEMM" in notes[0]
    assert select_expert_gemm("auto", "cpu", bf16, [], grouped_runs=True) == "loop"
    assert select_expert_gemm("loop", "cuda", bf16, [], grouped_runs=True) == "loop"
    assert select_expert_gemm("grouped", "cpu", torch.float32, [], grouped_runs=True) == "grouped"
    with pytest.raises(ConfigError, match="moe.expert_gemm: 'grouped' requested"):
        select_expert_gemm("grouped", "cuda", torch.float16, [], grouped_runs=False)
    with pytest.raises(ConfigError, match="expected auto, loop or grouped"):
        select_expert_gemm("fast", "cpu", bf16, [], grouped_runs=True)
    # the real probe on this machine, through select_kernels: a MoE run on the CPU loops
    from internlm_core.config.schema import MoEConfig
    k = select_kernels(ModelConfig(), AdamConfig(), resolve_precision("torch.float32", "cpu"), "cpu", log=False,
                       moe_cfg=MoEConfig())
    assert k.expert_gemm == "loop" and "expert GEMMs loop per expert" in k.notes
    assert select_kernels(ModelConfig(), AdamConfig(), resolve_precision("torch.float32", "cpu"), "cpu",
                          log=False).expert_gemm == "loop"


def test_expert_gemm_reaches_the_moe_layers():
    """The choice travels in ModelInputs to every MoE layer of the built model."""
    from internlm_core.config.loader import load_config
    from internlm_core.model import build_model
    cfg = load_config("configs/tiny.py", overrides=["model_type=INTERNLM_MoE", "model.num_experts=4",
                                                    "model.num_layers=2", "moe.expert_gemm=grouped"])
    inputs = dataclasses.replace(cfg.model_inputs(), expert_gemm="grouped")
    model = build_model(inputs, "meta")
    assert {layer.feed_forward.experts.gemm for layer in model.layers.values()} == {"grouped"}
    assert {layer.feed_forward.experts.gemm for layer in build_model(cfg, "meta").layers.values()} == {"loop"}


BF16, FP32 = "torch.bfloat16", "torch.float32"
VARLEN_BROKEN = Probe(installed=True, ok=False, detail="RuntimeError: FlashAttention only supports Ampere GPUs or newer")


@pytest.mark.parametrize("flash,varlen,dtype,overrides,expected,n_warnings,note", [
    (WORKING, WORKING, BF16, {}, "flash", 0, None),
    (NOT_INSTALLED, WORKING, BF16, {}, "torch_varlen", 0, "flash-attn not installed: attention on torch's varlen kernel"),
    (BROKEN, WORKING, BF16, {}, "torch_varlen", 1, None),
    (NOT_INSTALLED, NOT_INSTALLED, BF16, {}, "sdpa", 0, "attention on SDPA: packed rows take a dense [B, 1, T, T] "
                                                        "document mask (the last resort)"),
    (NOT_INSTALLED, VARLEN_BROKEN, BF16, {}, "sdpa", 1, "(the last resort)"),
    (WORKING, WORKING, FP32, {}, "sdpa", 0, "flash-attn takes 16-bit inputs (torch's varlen kernel too)"),
    (NOT_INSTALLED, WORKING, FP32, {"attn_backend": "torch_varlen"}, "torch_varlen", 0, "q/k/v cast to bf16"),
    (WORKING, WORKING, BF16, {"attn_backend": "torch_varlen"}, "torch_varlen", 0, None),
    (WORKING, WORKING, BF16, {"use_flash_attn": False}, "sdpa", 0, "use_flash_attn is False"),
])
def test_attention_on_cuda_flash_attn_else_torch_varlen_else_sdpa(flash, varlen, dtype, overrides, expected,
                                                                  n_warnings, note, caplog):
    """The probes monkeypatched: CUDA with and without flash-attn, torch's varlen kernel present, absent, broken."""
    model, adam, _ = configs(overrides)
    probes = {"probe_flash_attn": flash, "probe_torch_varlen": varlen, "probe_flash_cross_entropy": NOT_INSTALLED,
              "probe_apex": NOT_INSTALLED}
    with pytest.MonkeyPatch.context() as mp:
        for name, probe in probes.items():
            mp.setattr(accelerators, name, lambda device_type, probe=probe: probe)
        with caplog.at_level(logging.WARNING, logger="internlm_core"):
            k = select_kernels(model, adam, resolve_precision(dtype, "cuda"), "cuda")
    assert k.attention == expected
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == n_warnings, warnings
    if note is not None:
        assert note in k.describe()
    if flash is BROKEN and expected == "torch_varlen":
        assert warnings == ["flash-attn is installed but does not work (ImportError: flash_attn_2_cuda.so: undefined "
                            "symbol: _ZN3c10): attention falls back to torch's varlen kernel"]


def test_cpu_keeps_the_blocked_kernel_and_never_probes_torch_varlen(monkeypatch):
    def fail(device_type):
        raise AssertionError("probed on a CPU run")
    monkeypatch.setattr(accelerators, "probe_torch_varlen", fail)
    model, adam, _ = configs({})
    k = select_kernels(model, adam, resolve_precision(BF16, "cpu"), "cpu", log=False)
    assert k.attention == "cpu_blocked"


@pytest.mark.parametrize("device,varlen,message", [
    ("cpu", WORKING, "model.attn_backend: 'torch_varlen' requested but the device is cpu, not cuda; use 'auto' or "
                     "'sdpa'"),
    ("cuda", NOT_INSTALLED, "model.attn_backend: 'torch_varlen' requested but torch's varlen attention "
                            "(torch.nn.attention.varlen) is not installed; use 'auto' or 'sdpa'"),
    ("cuda", VARLEN_BROKEN, "model.attn_backend: 'torch_varlen' requested but torch's varlen attention "
                            "(torch.nn.attention.varlen) is installed but does not work (RuntimeError: "
                            "FlashAttention only supports Ampere GPUs or newer); use 'auto' or 'sdpa'"),
])
def test_torch_varlen_asked_for_and_unavailable_is_refused_in_one_line(device, varlen, message):
    model, adam, _ = configs({"attn_backend": "torch_varlen"})
    with pytest.raises(ConfigError) as e:
        select_kernels(model, adam, resolve_precision(BF16, device), device, probes=Probes(torch_varlen=varlen),
                       log=False)
    assert str(e.value) == message and "\n" not in message


def test_the_torch_varlen_probe_without_the_module_and_on_cpu(monkeypatch):
    import importlib.util
    accelerators.probe_torch_varlen.cache_clear()
    assert accelerators.probe_torch_varlen("cpu").why_not() == ("is installed but does not work (no varlen kernel on "
                                                                "cpu (CUDA only))")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch.nn.attention.varlen" else real(name, *a))
    accelerators.probe_torch_varlen.cache_clear()
    assert accelerators.probe_torch_varlen("cuda") == NOT_INSTALLED
    accelerators.probe_torch_varlen.cache_clear()
