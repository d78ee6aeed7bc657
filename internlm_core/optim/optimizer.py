"""AdamW with decay / no-decay groups, in the implementation `numerics.select_kernels` chose: torch's fused kernel,
torch's foreach one, or NVIDIA apex's FusedAdam (plain tensors on CUDA only); or Muon for the hidden matrices with
AdamW for the rest (optimizer.name = "muon", optim/muon.py)."""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch.distributed.tensor import DTensor

from ..config.schema import AdamConfig, OptimizerConfig
from ..errors import ConfigError
from ..model.qk_clip import install_logit_records
from ..model.roles import hidden_matrices
from ..numerics.kernels import OPTIMIZER as IMPLEMENTATIONS
from ..utils.logging import get_logger
from .muon import Muon, qk_clip

logger = get_logger(__name__)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Matrices decay; norms, biases and other 1-D parameters do not (as InternLM and HF do)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in groups if g["params"]]


_APEX_CLASS: Optional[type] = None


def apex_fused_adamw_class() -> type:
    """apex's FusedAdam with torch's `zero_grad(set_to_none=...)` signature.

    apex defines `zero_grad(self)` without arguments, so the trainer's `zero_grad(set_to_none=True)` and the one
    in torch.distributed.checkpoint's optimizer-state initialization (on resume) would raise TypeError. Here
    set_to_none=True calls apex's own zero_grad in the form it accepts (no arguments; apex then sets the
    gradients to None, its set_grad_none default), set_to_none=False zeroes them through torch's Optimizer."""
    global _APEX_CLASS
    if _APEX_CLASS is None:
        from apex.optimizers import FusedAdam

        class ApexFusedAdamW(FusedAdam):
            def zero_grad(self, set_to_none: bool = True) -> None:
                if set_to_none:
                    super().zero_grad()
                else:
                    torch.optim.Optimizer.zero_grad(self, set_to_none=False)

        _APEX_CLASS = ApexFusedAdamW
    return _APEX_CLASS


def build_qk_clip(model: torch.nn.Module, tau: Optional[float]) -> Optional[Callable[[], int]]:
    """optimizer.muon_qk_clip: the attention modules record their heads' largest logits (model/qk_clip.py) and the
    step ends with muon.qk_clip over them; None when off. ConfigError where it cannot hold (tensor parallel: the
    heads are split over ranks; q/k norms; no attention module with W_q / W_k)."""
    if tau is None:
        return None
    if any(isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()) for p in model.parameters()):
        raise ConfigError("optimizer.muon_qk_clip: not with parallel.tensor > 1 (each rank records and scales only "
                          "its own heads)")
    try:
        heads = install_logit_records(model)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if not heads:
        raise ConfigError("optimizer.muon_qk_clip: this model has no attention module with W_q / W_k to clip")
    logger.info(f"optimizer: qk-clip at {tau:g} over {len(heads)} attention modules (MuonClip)")
    return lambda: qk_clip(heads, tau)


def build_muon(model: torch.nn.Module, cfg: AdamConfig, opt: OptimizerConfig,
               blocks: Iterable[torch.nn.Module]) -> Muon:
    """Muon for the hidden matrices (model/roles.py's rule), AdamW for the rest: decay for the other matrices
    (embeddings, head, routers), none for 1-D parameters, as `param_groups`."""
    if cfg.fused == "apex":
        raise ConfigError("adam.fused: 'apex' is AdamW's kernel; optimizer.name='muon' runs its own AdamW part "
                          "(torch's single-tensor AdamW): use 'auto' or 'torch'")
    muon = hidden_matrices(model, blocks)
    chosen = {id(p) for p in muon}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in chosen]
    groups = [{"params": muon, "weight_decay": cfg.weight_decay, "use_muon": True, "name": "muon"},
              {"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay, "name": "decay"},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0, "name": "no_decay"}]
    groups = [g for g in groups if g["params"]]
    ns_dtype = opt.muon_ns_dtype
    if ns_dtype == "auto":  # bf16 matrix units on CUDA; most CPUs run bf16 matmuls far slower than fp32
        ns_dtype = "bfloat16" if any(p.device.type == "cuda" for p in muon) else "float32"
    optimizer = Muon(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                     momentum=opt.muon_momentum, nesterov=opt.muon_nesterov, ns_coefficients=opt.muon_ns_coefficients,
                     ns_steps=opt.muon_ns_steps, ns_dtype=ns_dtype, rms_scale=opt.muon_rms_scale,
                     ns_eps=opt.muon_eps, clip=build_qk_clip(model, opt.muon_qk_clip))
    logger.info(f"optimizer: Muon for {len(muon)} matrices of the blocks (Newton-Schulz {opt.muon_ns_steps} steps in "
                f"{ns_dtype}, update x {opt.muon_rms_scale} sqrt(max(rows, columns))), AdamW (single-tensor) "
                f"for {len(rest)} other tensors (embeddings, head, norms, biases, routers)")
    return optimizer


def contiguous_grads(optimizer: torch.optim.Optimizer, *_: object) -> None:
    """A step pre-hook: replace every non-contiguous gradient by a contiguous copy. torch's fused AdamW (2.13, CPU)
    reads a strided gradient as if it were contiguous and updates with the wrong elements, silently; the weight
    passes of the split-backward pipeline schedules (interleaved_zb, zbv, dualpipev) leave transposed gradients
    where FSDP does not replace them (no data or context parallel). Costs nothing when every gradient is
    contiguous."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is not None and not (g.to_local() if isinstance(g, DTensor) else g).is_contiguous():
                p.grad = g.contiguous()


def build_optimizer(model: torch.nn.Module, cfg: AdamConfig, impl: str, opt: Optional[OptimizerConfig] = None,
                    blocks: Optional[Iterable[torch.nn.Module]] = None) -> torch.optim.Optimizer:
    """AdamW over the model's parameter groups; `impl` is `Kernels.optimizer` ("apex", "fused", "foreach").
    With `opt.name` "muon": `build_muon` over the family plan's `blocks` of the model."""
    if opt is not None and opt.name == "muon":
        if blocks is None:
            raise ValueError("build_optimizer: optimizer.name='muon' needs the model's blocks (the plan's blocks)")
        return build_muon(model, cfg, opt, blocks)
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"optimizer implementation: expected one of {', '.join(IMPLEMENTATIONS)}, got {impl!r}")
    groups = param_groups(model, cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    if impl == "apex":
        if any(isinstance(p, DTensor) for g in groups for p in g["params"]):
            # select_kernels never chooses apex here; this guards a hand-built optimizer
            raise ConfigError("adam.fused: apex's FusedAdam cannot update DTensor parameters (FSDP2 / tensor "
                              "parallel): multi_tensor_adam reads raw storage; use 'auto' or 'torch'")
        opt = apex_fused_adamw_class()(groups, adam_w_mode=True, set_grad_none=True, **kwargs)
    else:
        opt = torch.optim.AdamW(groups, fused=impl == "fused", foreach=None if impl == "fused" else True, **kwargs)
    opt.register_step_pre_hook(contiguous_grads)
    logger.info(f"optimizer: AdamW ({impl}), {sum(len(g['params']) for g in groups)} tensors in {len(groups)} groups")
    return opt
