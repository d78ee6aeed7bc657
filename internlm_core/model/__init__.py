"""Model families (one folder each, registered by `model_type`), their specs, and the shared layers.

    spec = get_model_spec(cfg.model_type)          # ModelSpec: module, plan, adapters, config rules
    model = build_model(cfg.model_inputs(), device)  # a family sees ModelInputs (plain values), not the Config
"""

from .args import ModelArgs, analytic_parameter_count, args_from_model_config, ffn_width, flops_per_token
from .attention import (PackedMeta, build_packed_meta, cu_seqlens_from_document_ids, default_attention_backend,
                        document_ids_from_cu_seqlens)
from .init import copy_shard, init_parameters, materialize, parameter_generator
from .builder import (build_model, count_parameters, model_args, model_args_from_config, model_flops_per_token,
                      model_inputs, model_spec)
from .spec import (AdapterContext, MeshDim, MeshDimContext, ModelInputs, ModelSpec, ParallelPlan, ParallelSizes,
                   StageShapes, StateDictAdapter, TensorParallelOptions, TrainingHooks, canonical_model_type,
                   get_model_spec, model_types, register_model, unregister_model)
from . import internlm, internlm2, llama, internlm_moe  # noqa: E402,F401  (the built-in families register themselves)


def _import_families() -> None:
    """Import every other folder of this package (each family folder registers its spec on import): adding a family
    is adding its folder, nothing else."""
    import importlib
    import pkgutil
    for info in pkgutil.iter_modules(__path__):
        if info.ispkg:
            importlib.import_module(f"{__name__}.{info.name}")


_import_families()
from .internlm.model import Transformer

__all__ = ["AdapterContext", "MeshDim", "MeshDimContext", "ModelArgs", "ModelInputs", "ModelSpec", "ParallelSizes", "PackedMeta", "ParallelPlan", "StageShapes", "StateDictAdapter", "TensorParallelOptions", "TrainingHooks",
           "Transformer", "analytic_parameter_count", "args_from_model_config", "build_model", "build_packed_meta",
           "canonical_model_type", "copy_shard", "count_parameters", "cu_seqlens_from_document_ids",
           "default_attention_backend", "document_ids_from_cu_seqlens", "ffn_width", "flops_per_token",
           "get_model_spec", "init_parameters", "materialize", "model_args", "model_args_from_config", "model_inputs", "model_flops_per_token", "model_spec", "model_types",
           "parameter_generator", "register_model", "unregister_model"]
