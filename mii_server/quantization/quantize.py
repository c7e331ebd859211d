"""Quantize full-precision weight rows at load time: one symmetric scale per output row.

Each function takes float32 rows ``[r, K]`` (the whole input width, so a row-parallel shard gets the
same scale as the unsharded row) and the column range to keep, and returns the stored weight of those
columns with float32 scales ``[r, 1]`` such that ``weight ~= stored * scale``.
"""

from __future__ import annotations

import torch

from ..kernels.fp6_format import FP6_MAX, fp6_encode, pack_fp6
from ..kernels.reference_quant import FP8_DTYPE, FP8_MAX

INT8_MAX = 127.0
_SCALE_FLOOR = 1e-12  # an all-zero row keeps a positive scale (its codes are all zero)


def _row_scale(rows: torch.Tensor, largest: float) -> torch.Tensor:
    return (rows.abs().amax(dim=1, keepdim=True) / largest).clamp(min=_SCALE_FLOOR)  # [r, 1]


def quantize_int8(rows: torch.Tensor, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [r, length] (round to nearest even, within +-127) and scales [r, 1]."""
    scale = _row_scale(rows, INT8_MAX)
    codes = torch.round(rows[:, start : start + length] / scale).clamp(-INT8_MAX, INT8_MAX)
    return codes.to(torch.int8), scale


def quantize_fp6(rows: torch.Tensor, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed FP6 e3m2 uint8 [r, 3 length / 4] (nearest value) and scales [r, 1]."""
    scale = _row_scale(rows, FP6_MAX)
    return pack_fp6(fp6_encode(rows[:, start : start + length] / scale)), scale


def quantize_fp8(rows: torch.Tensor, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn [r, length] (round to nearest even) and scales [r, 1]."""
    scale = _row_scale(rows, FP8_MAX)
    return (rows[:, start : start + length] / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


QUANTIZERS = {"int8": quantize_int8, "fp6": quantize_fp6, "fp8": quantize_fp8}
