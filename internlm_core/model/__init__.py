"""The transformer family, attention backends and the model registry."""

from .attention import (PackedMeta, build_packed_meta, cu_seqlens_from_document_ids, document_ids_from_cu_seqlens,
                        flash_attn_available, select_attention_backend)
from .builder import MODEL_REGISTRY, apply_activation_checkpointing, build_model, model_args_from_config
from .transformer import ModelArgs, Transformer, analytic_parameter_count, count_parameters, flops_per_token

__all__ = ["MODEL_REGISTRY", "ModelArgs", "PackedMeta", "Transformer", "analytic_parameter_count",
           "apply_activation_checkpointing", "build_model", "build_packed_meta", "count_parameters",
           "cu_seqlens_from_document_ids", "document_ids_from_cu_seqlens",
           "flash_attn_available", "flops_per_token", "model_args_from_config", "select_attention_backend"]
