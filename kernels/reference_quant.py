"""Pure-PyTorch quantized linear ops: the CPU path and the oracle of ``triton_quant`` / ``triton_fp8``.

Every op computes ``y = x W^T (+ bias)`` for a weight stored in a quantized format with float32
scales ``scale [N, G]``: G groups of consecutive input columns per output row (G = 1: one scale per
output channel; HF fine-grained fp8 checkpoints have G = K / 128). x: [T, K] in the model dtype;
y: [T, N] in x's dtype. Products accumulate in float32 and the result is rounded once.

- ``int8_linear``: weight int8 [N, K] (weight-only; x stays in its dtype).
- ``fp6_linear``: weight FP6 e3m2 packed uint8 [N, 3 K / 4] (see ``fp6_format``; weight-only).
- ``fp8_linear``: weight float8_e4m3fn [N, K]; x is quantized to fp8 per token on the fly
  (``quantize_fp8_per_token``), so the product is what fp8 tensor cores compute, or arrives quantized
  already as ``Fp8Rows`` (from ``rms_norm_fp8``, the norm before it). ``gemm`` names the GPU
  implementation (``auto``, ``triton``, ``scaled_mm``); the reference is the oracle of both.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .fp6_format import fp6_values, unpack_fp6

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# why a floor: an all-zero token (padding rows of a CUDA-graph batch) must not divide by zero
FP8_SCALE_FLOOR = 1e-12


class Fp8Rows(NamedTuple):
    """Activations quantized per token, as ``quantize_fp8_per_token`` makes them, handed to an fp8
    linear instead of the model-dtype rows they came from."""

    values: torch.Tensor  # float8_e4m3fn [T, K]
    scale: torch.Tensor  # float32 [T]
    dtype: torch.dtype  # the model dtype the rows had: the linear's output dtype

    @property
    def shape(self) -> torch.Size:
        return self.values.shape


def expand_scale(scale: torch.Tensor, k: int) -> torch.Tensor:
    """float32 [N, G] group scales -> [N, K]: each scale repeated over its group of K / G columns."""
    groups = scale.shape[1]
    return scale.repeat_interleave(-(-k // groups), dim=1)[:, :k]


def _scaled_product(
    x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    # values: float32 [N, K] of the quantized weight; the scales applied in float32 before the product
    y = x.float() @ (values * expand_scale(scale, values.shape[1])).t()
    return (y if bias is None else y + bias.float()).to(x.dtype)


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, K] @ (int8 weight [N, K] * scale [N, G])^T + bias -> [T, N] in x's dtype."""
    return _scaled_product(x, weight.float(), scale, bias)


def dequantize_fp6(packed: torch.Tensor) -> torch.Tensor:
    """Packed FP6 uint8 [N, 3 K / 4] -> float32 [N, K] of the e3m2 values (unscaled)."""
    return fp6_values(packed.device)[unpack_fp6(packed).long()]


def fp6_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, K] @ (FP6 weight packed [N, 3 K / 4] * scale [N, G])^T + bias -> [T, N] in x's dtype."""
    return _scaled_product(x, dequantize_fp6(weight), scale, bias)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (float8_e4m3fn [T, K], float32 scales [T]) with x ~= q * scale per row;
    each row's largest magnitude maps to FP8_MAX (round to nearest even)."""
    scale = x.abs().amax(dim=-1).float().clamp(min=FP8_SCALE_FLOOR) / FP8_MAX  # [T]
    q = (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def fp8_linear(
    x: torch.Tensor | Fp8Rows,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    gemm: str = "auto",
) -> torch.Tensor:
    """x [T, K] quantized per token (or given quantized), @ (fp8 weight [N, K] * scale [N, G])^T + bias
    -> [T, N] in x's dtype."""
    del gemm  # one reference for every GPU implementation
    q, x_scale, dtype = x if isinstance(x, Fp8Rows) else (*quantize_fp8_per_token(x), x.dtype)
    w = weight.float() * expand_scale(scale, weight.shape[1])
    y = (q.float() @ w.t()) * x_scale[:, None]
    return (y if bias is None else y + bias.float()).to(dtype)


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Any of the three quantized weights -> [N, K] in ``dtype`` (the scales applied in float32)."""
    values = dequantize_fp6(weight) if weight.dtype == torch.uint8 else weight.float()
    return (values * expand_scale(scale, values.shape[1])).to(dtype)

