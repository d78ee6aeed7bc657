"""Block-scaled FP8 Hugging Face folders (DeepSeek-V3's and Kimi-K2's published weights, Qwen3's -FP8 folders):
read dequantized.

Such a folder's config.json has `quantization_config` = {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128], ...}; a quantized weight `X.weight` is stored float8_e4m3fn beside
`X.weight_scale_inv` (fp32, one value per block of 128 x 128 elements, the last blocks partial), and its value is
weight[i, j] = fp8[i, j] * scale_inv[i // 128, j // 128] (DeepSeek's weight_dequant). The weights that are not
quantized (embedding, head, norms, routers) are stored as they are. Import multiplies each quantized weight by its
scale in fp32 (the model's own dtype follows on copy); a scale is read with its weight, never on its own, and a
float8 weight without one is refused, as is any other quantization method.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from ..errors import CheckpointError

SCALE = "_scale_inv"
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def block_size(c: Mapping[str, Any], where: str) -> Optional[tuple[int, int]]:
    """The (rows, columns) of a scale block of a block-scaled FP8 folder (its config.json `c`); None: the folder
    is not quantized. Another quant_method, or FP8 without a block size, is a CheckpointError."""
    q = c.get("quantization_config")
    if not q:
        return None
    method, block = q.get("quant_method"), q.get("weight_block_size")
    if method != "fp8" or not (isinstance(block, (list, tuple)) and len(block) == 2):
        raise CheckpointError(f"{where}: quantization_config {dict(q)}: only block-scaled FP8 folders (quant_method "
                              f"fp8 with weight_block_size [rows, columns]) are read (dequantized)")
    if q.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{where}: quantization_config fmt={q.get('fmt')!r}: only e4m3 weights are read")
    return int(block[0]), int(block[1])


def scale_names(names: list[str], available: Mapping[str, Any]) -> list[str]:
    """The scales (`X_scale_inv`) of the folder that go with the weights `names`."""
    return [n + SCALE for n in names if n + SCALE in available]


def is_scale_of(name: str, wanted: set[str]) -> bool:
    """Whether `name` is the scale of a tensor in `wanted` (read with it)."""
    return name.endswith(SCALE) and name[:-len(SCALE)] in wanted


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 weight[i, j] = weight[i, j] * scale_inv[i // rows, j // columns]."""
    rows, cols = weight.shape
    if tuple(scale_inv.shape) != (-(-rows // block[0]), -(-cols // block[1])):
        raise CheckpointError(f"a [{rows}, {cols}] weight with a {list(scale_inv.shape)} scale: expected one scale "
                              f"per {block[0]} x {block[1]} block")
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


def dequantize_all(tensors: dict[str, torch.Tensor], block: Optional[tuple[int, int]],
                   where: str) -> dict[str, torch.Tensor]:
    """`tensors` with every quantized weight dequantized and the scales removed; a float8 tensor without its scale
    (or in a folder without quantization_config) is a CheckpointError naming it."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE) and name[:-len(SCALE)] in tensors:
            continue
        if t.dtype in FLOAT8:
            if block is None or name + SCALE not in tensors:
                raise CheckpointError(f"{where}: {name} is {t.dtype} without {name + SCALE} (or the folder's "
                                      f"config.json has no quantization_config): its scale is unknown")
            t = dequantize(t, tensors[name + SCALE], block)
        out[name] = t
    return out
