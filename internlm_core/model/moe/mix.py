"""Which blocks of an MoE stack are mixture-of-experts and which dense: one rule for every MoE family.

Hugging Face's MoE classes make some decoder layers dense (a plain SwiGLU MLP of width `intermediate_size`, the
experts having `moe_intermediate_size`), each family with its own keys. `LayerMix` holds them under the same names
(the config's `model` section spells them so, and a family's adapter maps a folder's keys one to one):

    first_k_dense_replace   DeepSeek-V2/V3: blocks 0 .. k-1 dense (transformers: MoE iff i >= k)
    decoder_sparse_step     Qwen2-MoE / Qwen3-MoE: only every step-th block MoE, (i + 1) % step == 0
    mlp_only_layers         Qwen2-MoE / Qwen3-MoE: these blocks dense whatever the step

Block i is MoE iff i >= first_k_dense_replace and (i + 1) % decoder_sparse_step == 0 and i not in
mlp_only_layers (the defaults 0, 1, (): every block MoE). With a DeepSeek folder's keys alone (step 1, no list) it
is transformers' DeepseekV3DecoderLayer rule, with a Qwen folder's (k 0) Qwen3MoeDecoderLayer's.

How a family uses it:
1. its args carry a `LayerMix` (`MoEModelArgs.layer_mix`, filled by `layer_mix_of(config.model)`), and its module
   builds block i's FFN as `MoEFeedForward` where `mix.is_moe(i)`, else the dense FFN of width
   `ModelArgs.ffn_width` (the config's `intermediate_size`; the experts' width is `moe_intermediate_size`);
   `internlm_moe/model.py`'s `MoETransformer.make_feed_forward` does exactly this;
2. its rules call `mix.check(num_layers)` (a ConfigError naming the key);
3. its adapters read / write the folder's keys (`dense_prefix` says whether the dense blocks are a prefix, what a
   first_k_dense_replace-only class can hold); its counts give a dense block's terms where `not mix.is_moe(i)`
   (`ModelCounts.layer_args`). Expert parallel, FSDP's expert mesh, the aux losses and the metrics find the MoE
   layers by type, so dense blocks need nothing there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

from ...errors import ConfigError

MIX_KEYS = ("first_k_dense_replace", "decoder_sparse_step", "mlp_only_layers")


@dataclass(frozen=True)
class LayerMix:
    """The dense / MoE choice of every block (module docstring); the defaults make every block MoE."""

    first_k_dense_replace: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "mlp_only_layers", tuple(sorted({int(i) for i in self.mlp_only_layers})))

    def is_moe(self, layer: int) -> bool:
        """Whether block `layer` has the MoE FFN (else the dense SwiGLU)."""
        return (layer >= self.first_k_dense_replace and (layer + 1) % self.decoder_sparse_step == 0
                and layer not in self.mlp_only_layers)

    def moe_layers(self, num_layers: int) -> tuple[int, ...]:
        """The MoE blocks of a `num_layers` stack, in order."""
        return tuple(i for i in range(num_layers) if self.is_moe(i))

    def dense_layers(self, num_layers: int) -> tuple[int, ...]:
        """The dense blocks of a `num_layers` stack, in order."""
        return tuple(i for i in range(num_layers) if not self.is_moe(i))

    @property
    def uniform(self) -> bool:
        """Every block MoE whatever the depth (the keys at their defaults)."""
        return self == LayerMix()

    def dense_prefix(self, num_layers: int) -> Optional[int]:
        """k when the dense blocks of a `num_layers` stack are exactly 0 .. k-1 (what first_k_dense_replace alone
        expresses), else None."""
        dense = self.dense_layers(num_layers)
        return len(dense) if dense == tuple(range(len(dense))) else None

    def check(self, num_layers: int) -> None:
        """A ConfigError naming the key when a value is out of range or the stack would hold no MoE block."""
        if self.first_k_dense_replace < 0:
            raise ConfigError(f"model.first_k_dense_replace: expected an int >= 0, got {self.first_k_dense_replace}")
        if self.decoder_sparse_step < 1:
            raise ConfigError(f"model.decoder_sparse_step: expected an int >= 1, got {self.decoder_sparse_step}")
        outside = [i for i in self.mlp_only_layers if not 0 <= i < num_layers]
        if outside:
            raise ConfigError(f"model.mlp_only_layers: {outside} are not blocks of model.num_layers={num_layers} "
                              f"(expected indices 0 .. {num_layers - 1})")
        if not self.moe_layers(num_layers):
            raise ConfigError(f"model.first_k_dense_replace={self.first_k_dense_replace}, model.decoder_sparse_step="
                              f"{self.decoder_sparse_step}, model.mlp_only_layers={list(self.mlp_only_layers)}: no "
                              f"block of model.num_layers={num_layers} is MoE; use a dense model_type")


def layer_mix_of(m: Any) -> LayerMix:
    """The LayerMix of a `model` config section (its typed fields MIX_KEYS; None values are the defaults)."""
    k, step, only = (getattr(m, key) for key in MIX_KEYS)
    return LayerMix(first_k_dense_replace=0 if k is None else _int(k, "first_k_dense_replace"),
                    decoder_sparse_step=1 if step is None else _int(step, "decoder_sparse_step"),
                    mlp_only_layers=_indices(only or ()))


def _int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"model.{key}: expected an int, got {value!r}")
    return value


def _indices(values: Iterable[Any]) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in values):
        raise ConfigError(f"model.mlp_only_layers: expected a list of block indices, got {values!r}")
    return tuple(values)
