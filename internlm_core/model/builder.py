"""Build a model through its family's spec, from `ModelInputs` (or a config, which makes them)."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from .attention import default_attention_backend
from .init import materialize
from .spec import ModelInputs, ModelSpec, get_model_spec

# a ModelInputs, or an object that makes one (config.Config.model_inputs()): the model package reads nothing else
ModelSource = Union[ModelInputs, Any]


def model_inputs(source: ModelSource) -> ModelInputs:
    """`source` itself, or the ModelInputs its `model_inputs()` makes (a Config)."""
    return source if isinstance(source, ModelInputs) else source.model_inputs()


def model_spec(source: ModelSource) -> ModelSpec:
    """The spec of the source's `model_type`."""
    return get_model_spec(model_inputs(source).model_type)


def model_args(source: ModelSource, device_type: str = "cpu", attn_backend: Optional[str] = None) -> Any:
    """The family's module args. `attn_backend`: the attention kernel a run chose (numerics.select_kernels);
    without it the plain one of `device_type` (see default_attention_backend)."""
    inputs = model_inputs(source)
    return get_model_spec(inputs.model_type).build_args(inputs, attn_backend or default_attention_backend(device_type))


def build_model(source: ModelSource, device: torch.device | str = "cpu", seed: Optional[int] = None,
                attn_backend: Optional[str] = None) -> torch.nn.Module:
    """The model: built on the meta device, then (unless `device` is "meta") materialized on `device` and
    initialized from `seed` (default: the config's `seed`, else 0) as every parallel layout initializes it.
    `attn_backend`: the run's attention kernel (see model_args)."""
    device = torch.device(device)
    args = model_args(source, device.type, attn_backend=attn_backend)
    with torch.device("meta"):
        model = model_spec(source).module(args)
    if device.type != "meta":
        if seed is None:  # a config's `seed`; ModelInputs carry none
            seed = 0 if isinstance(source, ModelInputs) else source.seed
        materialize(model, device, seed)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def model_flops_per_token(source: ModelSource, args: Any) -> int:
    """Model FLOPs per trained token of the family (0 when the family does not say)."""
    inputs = model_inputs(source)
    fn = get_model_spec(inputs.model_type).flops_per_token
    return int(fn(args, inputs.seq_len)) if fn is not None else 0


# the name callers used before ModelInputs; the same function
model_args_from_config = model_args
